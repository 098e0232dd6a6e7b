"""State-space mixers in plain torch, trained by the Trainer at t=2 (with and without SP) against one
process. Mamba-2's shape (as Zamba-2, Bamba, Falcon-H1 and Nemotron-H use it):

- one projection fused of unequal parts, gate | x | B | C | dt, of different unit sizes (heads of
  the head size, one group of the state size, a scalar per head), its x | B | C cut again after a
  depthwise causal conv over them: x splits by heads while B and C, one group shared by every head,
  stay whole on every rank (as does their share of the conv's weight and bias);
- B and C repeated onto the heads with ``output_size`` naming the heads;
- a recurrent state made from sizes alone, per-head parameters (dt bias, decay, skip);
- a gated norm over all heads' features, viewed into groups by a size read from its input: run
  whole on the gathered features, each rank keeping its share;
- the conv's weight read squeezed, as a kernel's fallback reads it, and also handed to the optional
  kernel, absent, which reads nothing (held as each rank's channels all the same).

Mamba-1's shape (as Falcon-Mamba and Jamba use it): x_proj reads the split channels and its reduced
dt | B | C are read beside them again (an inner row); dt_proj's weight, applied by a matmul to the
whole dt, and the per-channel A and D are held as each rank's rows; the scan's state is zeros sized by
a read of the channels' shape, and C is applied by a matmul of the channels' rows.

Gradient clipping is on, at a norm every step exceeds: copied rows must count once.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ, VOCAB, HIDDEN, HEADS, HEAD, STATE, GROUPS, KERNEL, RANK = 8, 16, 16, 4, 4, 4, 1, 3, 2
INNER = HEADS * HEAD
CONV = INNER + 2 * GROUPS * STATE  # x | B | C
TOL = 1e-5  # fp32: the same arithmetic up to summation order (t=2 splits each row's sum in two)
CLIP = 0.05  # below every step's gradient norm: each update is scaled by the norm


class GroupGatedNorm(nn.Module):
    def __init__(self, width: int, group: int) -> None:
        super().__init__()
        self.weight, self.group = nn.Parameter(torch.linspace(0.5, 1.5, width)), group

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = x * F.silu(gate)
        *lead, width = x.shape
        groups = x.view(*lead, width // self.group, self.group)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * groups.view(*lead, width)


def _fused_kernel(weight: torch.Tensor) -> torch.Tensor | None:
    """A kernel the environment lacks (as a hub kernel's fallback returns None): reads nothing."""
    return None


class StateSpaceMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_in = nn.RMSNorm(HIDDEN)
        self.in_proj = nn.Linear(HIDDEN, INNER + CONV + HEADS, bias=False)  # gate | x | B | C | dt
        self.conv = nn.Conv1d(CONV, CONV, KERNEL, groups=CONV, padding=KERNEL - 1)
        self.dt_bias = nn.Parameter(torch.linspace(-1.0, 1.0, HEADS))
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 4.0, HEADS)))
        self.D = nn.Parameter(torch.linspace(0.5, 1.5, HEADS))
        self.norm = GroupGatedNorm(INNER, INNER // GROUPS)
        self.out_proj = nn.Linear(INNER, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_in(x)
        B, T, _ = h.shape
        gate, xbc, dt = self.in_proj(h).split([INNER, CONV, HEADS], dim=-1)
        fused = _fused_kernel(self.conv.weight.squeeze(1))  # an optional kernel, absent: its argument unread
        taps = self.conv.weight.squeeze(1)  # (CONV, KERNEL): the fallback's own read of the conv
        xbc = F.conv1d(xbc.transpose(1, 2), taps.unsqueeze(1), self.conv.bias, padding=KERNEL - 1, groups=CONV)
        xbc = F.silu(xbc[..., :T]).transpose(1, 2) if fused is None else fused  # (B, T, CONV)
        u, b, c = xbc.split([INNER, GROUPS * STATE, GROUPS * STATE], dim=-1)
        u = u.view(B, T, HEADS, HEAD)  # (B, T, nh, hd)
        b, c = (t.view(B, T, GROUPS, STATE).repeat_interleave(HEADS // GROUPS, 2, output_size=HEADS) for t in (b, c))
        dt = F.softplus(dt + self.dt_bias)  # (B, T, nh)
        decay = torch.exp(-torch.exp(self.A_log) * dt)
        state = torch.zeros(B, HEADS, HEAD, STATE)  # the config's head count: 1/t of it on each rank
        ys = []
        for t in range(T):
            state = (
                decay[:, t, :, None, None] * state + (dt[:, t, :, None, None] * u[:, t, :, :, None]) * b[:, t, :, None]
            )
            ys.append((state * c[:, t, :, None]).sum(-1))  # (B, nh, hd)
        y = torch.stack(ys, dim=1) + u * self.D[:, None]  # (B, T, nh, hd)
        return x + self.out_proj(self.norm(y.reshape(B, T, INNER), gate))


class SelectiveScanMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_in = nn.RMSNorm(HIDDEN)
        self.in_proj = nn.Linear(HIDDEN, 2 * INNER, bias=False)  # x | z
        self.conv = nn.Conv1d(INNER, INNER, KERNEL, groups=INNER, padding=KERNEL - 1)
        self.x_proj = nn.Linear(INNER, RANK + 2 * STATE, bias=False)  # dt | B | C from all channels
        self.dt_proj = nn.Linear(RANK, INNER)  # its weight read by a matmul, never called
        self.A_log = nn.Parameter(torch.log(torch.arange(1.0, STATE + 1)).repeat(INNER, 1))
        self.D = nn.Parameter(torch.linspace(0.5, 1.5, INNER))
        self.out_proj = nn.Linear(INNER, HIDDEN, bias=False)
        self.norm_mlp, self.up, self.down = nn.RMSNorm(HIDDEN), nn.Linear(HIDDEN, INNER), nn.Linear(INNER, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mix(x)
        return x + self.down(F.gelu(self.up(self.norm_mlp(x))))  # a region of its own after the mixer's

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_in(x)
        T = h.shape[1]
        u, z = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)  # (B, C, T)
        u = F.silu(self.conv(u)[..., :T])
        dt, b, c = self.x_proj(u.transpose(1, 2)).split([RANK, STATE, STATE], dim=-1)  # whole on every rank
        dt = F.softplus(self.dt_proj.weight @ dt.transpose(1, 2) + self.dt_proj.bias[:, None])  # (B, C, T)
        A = -torch.exp(self.A_log)  # (C, N)
        batch, channels, length = u.shape  # this rank's channels
        state = torch.zeros(batch, channels, STATE)
        ys = []
        for t in range(length):
            state = torch.exp(A * dt[:, :, t, None]) * state + (dt[:, :, t, None] * b[:, t, None]) * u[:, :, t, None]
            ys.append(torch.matmul(state, c[:, t, :, None])[..., 0])  # (B, C)
        y = torch.stack(ys, dim=-1) + u * self.D[:, None]
        return x + self.out_proj((y * F.silu(z)).transpose(1, 2))


def fit_selective(t: int, sequence_parallel: bool) -> dict:
    from tests.tp_utils import TokenLM, fit_token_lm

    make = functools.partial(TokenLM, lambda: [SelectiveScanMixer(), SelectiveScanMixer()], VOCAB, HIDDEN)
    model, result = fit_token_lm(
        make, vocab=VOCAB, seq=SEQ, t=t, sequence_parallel=sequence_parallel, gradient_clip_val=CLIP
    )
    mixer = model.blocks[0]
    names = (
        "in_proj.weight",
        "conv.weight",
        "dt_proj.weight",
        "dt_proj.bias",
        "A_log",
        "D",
        "out_proj.weight",
        "up.weight",
    )
    shapes = {n: tuple(p.shape) for n, p in mixer.named_parameters() if n in (*names, "x_proj.weight")}
    return {**result, "shapes": shapes}


def fit(t: int, sequence_parallel: bool) -> dict:
    from tests.tp_utils import TokenLM, fit_token_lm

    make = functools.partial(TokenLM, lambda: [StateSpaceMixer(), StateSpaceMixer()], VOCAB, HIDDEN)
    model, result = fit_token_lm(
        make, vocab=VOCAB, seq=SEQ, t=t, sequence_parallel=sequence_parallel, gradient_clip_val=CLIP
    )
    mixer = model.blocks[0]
    return {**result, "rows": {n: p.shape[0] for n, p in mixer.named_parameters() if n.startswith(("in_proj", "conv"))}}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["t2", "t2-sp"])
def test_a_state_space_mixer_splits_its_heads_with_its_one_group_whole_equal_to_one_process(
    dist_pool, sequence_parallel
):
    from tests.tp_utils import t2_runs

    for split in t2_runs(dist_pool, fit, sequence_parallel, TOL):
        assert split["warnings"] == []
        conv_rows = INNER // 2 + 2 * GROUPS * STATE  # half the heads' channels, B's and C's whole
        assert split["rows"] == {
            "in_proj.weight": INNER // 2 + conv_rows + HEADS // 2,
            "conv.weight": conv_rows,
            "conv.bias": conv_rows,
        }


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["t2", "t2-sp"])
def test_a_selective_scan_mixer_splits_its_channels_around_an_inner_row_equal_to_one_process(
    dist_pool, sequence_parallel
):
    from tests.tp_utils import t2_runs

    half = INNER // 2
    for split in t2_runs(dist_pool, fit_selective, sequence_parallel, TOL):
        assert split["warnings"] == []
        assert split["shapes"] == {
            "in_proj.weight": (INNER, HIDDEN),  # half of x and half of z
            "conv.weight": (half, 1, KERNEL),
            "x_proj.weight": (RANK + 2 * STATE, half),  # the inner row: this rank's channels
            "dt_proj.weight": (half, RANK),  # rows of the channels, held as this rank's
            "dt_proj.bias": (half,),
            "A_log": (half, STATE),
            "D": (half,),
            "out_proj.weight": (HIDDEN, half),
            "up.weight": (half, HIDDEN),
        }
