"""apply_kernels on ordinary models: same training as torch, same parameters, clear errors."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

pytest.importorskip("triton")

from lightning_ptdp import triton_kernels  # noqa: E402
from lightning_ptdp.kernels import KERNELS, KernelReport, apply_kernels, remove_kernels  # noqa: E402

# fp32 end to end: flash attention and the fused GeLU differ from torch only in summation order
# (~1e-6 per op); three optimizer steps of a 2-block model keep that well under 1e-4.
LOSS_TOL = dict(atol=1e-4, rtol=1e-4)
# bf16 autocast: both paths round activations to bf16 (eps 7.8e-3) but at different points
# (torch adds the bias in bf16, bias_gelu in fp32); logits are O(1) after two blocks.
AUTOCAST_TOL = dict(atol=3e-2, rtol=3e-2)
VOCAB, DIM, HEADS, SEQ, BATCH = 37, 32, 2, 17, 2  # head_dim 16, odd sequence: ragged tiles


class Attention(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.head_dim, self.kv_heads = DIM // HEADS, kv_heads
        self.qkv = nn.Linear(DIM, DIM + 2 * kv_heads * self.head_dim)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        B, T, C = x.shape
        kv = self.kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([C, kv, kv], dim=-1)
        q = q.view(B, T, HEADS, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != HEADS)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class ModuleGeluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.act = nn.GELU(approximate="tanh")
        self.out = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class FunctionalGeluMLP(ModuleGeluMLP):
    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


def sequential_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))


MLPS = {"module": ModuleGeluMLP, "functional": FunctionalGeluMLP, "sequential": sequential_mlp}


class Block(nn.Module):
    def __init__(self, mlp: str, kv_heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention(kv_heads)
        self.mlp = MLPS[mlp]()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, mlp: str = "module", kv_heads: int = HEADS, recompute: bool = False) -> None:
        super().__init__()
        self.recompute = recompute
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(mlp, kv_heads) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return self.head(x)


def _model(**kwargs) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(**kwargs)


def _train(model, device, steps=3):
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)


@pytest.fixture
def spies(monkeypatch):
    """Counts calls that reached the Triton kernels."""
    counts = {"flash_attention": 0, "bias_gelu": 0}
    for name in counts:
        real = getattr(triton_kernels, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(triton_kernels, name, spy)
    return counts


@pytest.mark.parametrize(("mlp", "kv_heads"), [("module", HEADS), ("functional", 1), ("sequential", HEADS)])
def test_training_matches_torch(device, spies, mlp, kv_heads):
    reference = _train(_model(mlp=mlp, kv_heads=kv_heads), device)
    model = _model(mlp=mlp, kv_heads=kv_heads)
    apply_kernels(model, "triton", device=device)
    torch.testing.assert_close(_train(model, device), reference, **LOSS_TOL)
    assert spies == {"flash_attention": 2 * 3, "bias_gelu": 2 * 3}  # 2 blocks x 3 steps


def test_parameters_and_state_dict_keys_unchanged(device):
    model = _model(mlp="functional")
    params_before = list(model.named_parameters())
    keys_before = list(model.state_dict())
    apply_kernels(model, "triton", device=device)
    assert list(model.state_dict()) == keys_before
    assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in params_before]
    _train(model, device, steps=1)
    assert model.blocks[0].mlp.fc.bias.grad is not None  # the fused bias still trains


def test_report_lists_replaced_modules(device):
    report = apply_kernels(_model(mlp="module"), "triton", device=device)
    assert report == KernelReport(
        mode="triton",
        backend="triton",
        attention=("blocks.0.attn", "blocks.1.attn"),
        bias_gelu=("blocks.0.mlp.fc -> blocks.0.mlp.act", "blocks.1.mlp.fc -> blocks.1.mlp.act"),
    )
    assert "flash attention in 2 module(s), bias-GeLU fused in 2 pair(s)" in report.summary()
    functional = apply_kernels(_model(mlp="sequential"), "triton", device=device)
    assert functional.bias_gelu == ("blocks.0.mlp.0 -> blocks.0.mlp.1", "blocks.1.mlp.0 -> blocks.1.mlp.1")


def test_activation_checkpointing_recomputes_through_kernels(device, spies):
    reference = _model(recompute=True)
    model = _model(recompute=True)
    apply_kernels(model, "triton", device=device)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2)).to(device)
    for m in (reference, model):
        m.to(device)(tokens).square().mean().backward()
    assert spies == {"flash_attention": 2 * 2, "bias_gelu": 2 * 2}  # forward + recompute, 2 blocks
    for (name, want), got in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(got.grad, want.grad, **LOSS_TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_autocast_runs_kernels_in_the_autocast_dtype(device, spies):
    reference, model = _model(mlp="functional").to(device), _model(mlp="functional").to(device)
    apply_kernels(model, "triton", device=device)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        want, got = reference(tokens), model(tokens)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), **AUTOCAST_TOL)
    assert spies == {"flash_attention": 2, "bias_gelu": 2}


def test_auto_on_cpu_without_interpreter_changes_nothing(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = _model()
    report = apply_kernels(model, "auto", device=torch.device("cpu"))
    assert report.backend == "torch" and "CUDA device" in report.reason
    assert all(not m._forward_pre_hooks for m in model.modules())


def _on_gpu_class(monkeypatch, capability: tuple[int, int], measured: dict | None = None) -> None:
    """Plan as on a CUDA device of ``capability``, with ``measured`` as the suite's recorded verdicts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if measured is not None:
        monkeypatch.setattr("lightning_ptdp.kernels.MEASURED_FASTER", measured)


def test_auto_leaves_cpu_calls_to_torch_even_with_interpreter(monkeypatch, spies):
    _on_gpu_class(monkeypatch, (9, 0), {"sm90": frozenset(KERNELS)})
    model = _model()
    assert apply_kernels(model, "auto", device=torch.device("cuda")).backend == "triton"  # planned for a GPU
    model(torch.zeros(1, 5, dtype=torch.long))  # run on CPU: "auto" never takes the interpreter
    assert spies == {"flash_attention": 0, "bias_gelu": 0}


@pytest.mark.parametrize(
    ("capability", "reason"),
    [
        ((9, 0), "not measured faster end to end on sm90"),
        ((8, 0), "no end-to-end measurement on sm80"),
        ((7, 5), "no end-to-end measurement on sm75"),
    ],
)
def test_auto_routes_nothing_that_was_not_measured_faster(monkeypatch, capability, reason):
    """The H100 suite measured neither kernel faster end to end (ptdp-torch 0.990 of Lightning, with the
    bias-GeLU 0.973, with both 0.921), and no other class was measured: "auto" installs nothing."""
    _on_gpu_class(monkeypatch, capability)
    model = _model()
    report = apply_kernels(model, "auto", device=torch.device("cuda"))
    assert report.backend == "torch" and reason in report.reason and reason in report.summary()
    assert "_ptdp_kernel_router" not in model.__dict__
    assert all(not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("routes", [{"attention"}, {"bias_gelu"}, {"attention", "bias_gelu"}])
def test_auto_routes_what_the_suite_measured_faster(monkeypatch, routes):
    _on_gpu_class(monkeypatch, (9, 0), {"sm90": frozenset(routes), "sm80": frozenset(KERNELS)})
    model = _model()
    report = apply_kernels(model, "auto", device=torch.device("cuda"))
    assert report.backend == "triton"
    assert bool(report.attention) is ("attention" in routes)
    assert bool(report.bias_gelu) is ("bias_gelu" in routes)
    assert model.__dict__["_ptdp_kernel_router"].route_attention is ("attention" in routes)
    for name, note in (("attention", report.attention_note), ("bias_gelu", report.bias_gelu_note)):
        assert (note is None) is (name in routes)
        assert name in routes or "not measured faster end to end on sm90" in note
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    assert attention and all(bool(m._forward_pre_hooks) is ("attention" in routes) for m in attention)


def test_context_parallelism_leaves_attention_alone_even_where_it_measured_faster(monkeypatch):
    _on_gpu_class(monkeypatch, (9, 0), {"sm90": frozenset({"attention"})})
    report = apply_kernels(_model(), "auto", device=torch.device("cuda"), attention=False)
    assert report.backend == "torch" and "context parallelism" in report.reason


def test_triton_mode_routes_attention_whatever_the_capability(monkeypatch, spies):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    model = _model()
    report = apply_kernels(model, "triton", device=torch.device("cpu"))
    assert report.attention and report.attention_note is None
    model(torch.zeros(1, 5, dtype=torch.long))
    assert spies["flash_attention"] > 0


def test_torch_mode_and_remove_kernels_are_no_ops(device):
    model = _model()
    assert apply_kernels(model, "torch").backend == "torch"
    assert all(not m._forward_pre_hooks for m in model.modules())
    apply_kernels(model, "triton", device=device)
    remove_kernels(model)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_deepcopy_keeps_fusing_the_copy(device, spies):
    model = _model()
    apply_kernels(model, "triton", device=device)
    clone = copy.deepcopy(model).to(device)
    tokens = torch.zeros(1, 5, dtype=torch.long, device=device)
    torch.testing.assert_close(clone(tokens), model.to(device)(tokens))
    assert spies["bias_gelu"] == 2 * 2


def test_invalid_mode():
    with pytest.raises(ValueError, match=r"kernels='cuda' is not one of 'auto', 'triton', 'torch'; choose one"):
        apply_kernels(_model(), "cuda")


def test_triton_mode_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        RuntimeError,
        match=r"kernels='triton' needs a CUDA device or TRITON_INTERPRET=1 \(the CPU interpreter\), but the model "
        r"runs on cpu and TRITON_INTERPRET is unset; use kernels='auto' .* or kernels='torch'",
    ):
        apply_kernels(_model(), "triton", device=torch.device("cpu"))


class _Masked(nn.Module):
    def __init__(self, head_dim: int = 16, masked: bool = False) -> None:
        super().__init__()
        self.head_dim, self.masked = head_dim, masked

    def forward(self, x):
        q = x.view(1, 2, -1, self.head_dim)
        mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=x.device) if self.masked else None
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.parametrize(
    ("module", "match"),
    [
        (
            _Masked(masked=True),
            r"cannot run scaled_dot_product_attention in _Masked: attn_mask is given; .*; use kernels=",
        ),
        (_Masked(head_dim=24), r"head_dim q/k/v = 24/24/24; .*\(16, 32, 64, 128\); use kernels='auto'"),
    ],
)
def test_triton_mode_rejects_unsupported_attention(device, module, match):
    apply_kernels(module, "triton", device=device)
    with pytest.raises(ValueError, match=match):
        module(torch.randn(2 * 8 * module.head_dim, device=device))


def test_auto_falls_back_to_torch_for_masked_attention(monkeypatch, spies):
    _on_gpu_class(monkeypatch, (9, 0), {"sm90": frozenset({"attention"})})
    module = _Masked(masked=True)
    apply_kernels(module, "auto", device=torch.device("cuda"))
    assert module._forward_pre_hooks  # routed (at run time: torch.fx cannot trace the mask's shape)
    x = torch.randn(2 * 8 * 16)
    torch.testing.assert_close(module(x), _Masked(masked=True)(x))
    assert spies["flash_attention"] == 0


class _Branchy(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        if x.sum() > -1e9:
            x = self.fc(x)
        return F.scaled_dot_product_attention(x, x, x)


def test_untraceable_module_is_reported_and_still_routes_attention(device, spies):
    module = _Branchy().to(device)
    report = apply_kernels(module, "triton", device=device)
    assert report.skipped and report.skipped[0][0] == "_Branchy"
    assert "torch.fx could not trace it" in report.skipped[0][1]
    module(torch.randn(1, 2, 5, 16, device=device))
    assert spies["flash_attention"] == 1


class _Switch(nn.Module):
    """Traces as Linear -> GeLU, but a flag flipped later sends the Linear output elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.skip_gelu = nn.Linear(16, 16), nn.GELU(), False

    def forward(self, x):
        h = self.fc(x)
        return h * 2 if self.skip_gelu else self.act(h)


def test_linear_output_not_reaching_its_gelu_is_an_error(device):
    module = _Switch().to(device)
    apply_kernels(module, "triton", device=device)
    module.skip_gelu = True
    with pytest.raises(RuntimeError, match=r"the output of fc was fused with its GeLU at trace time, but at run"):
        module(torch.randn(3, 16, device=device))
