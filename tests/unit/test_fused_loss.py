"""The fused head and loss (parallel/head_logits.py, parallel/fused_loss.py) in one process: the loss
idioms of transformers, litgpt and nanoGPT give the unfused head's loss and gradients, no tensor as
large as the logits is ever made, and any other use of the logits gets them computed as before.

Tolerance: ``FP32_REL`` = 1e-5 relative (the issue's). Fusion changes only the order in which rows'
losses and the chunks' weight gradients are summed; each row's loss is the same ops on the same
values. fp32 sums of 24-96 terms in another order differ by a few ulp (1.2e-7 each), well inside
1e-5; a wrong row, shift or ignore rule moves the loss by 1e-2 or more.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ptdp import ParallelConfig
from lightning_ptdp.parallel import chunked_loss
from lightning_ptdp.parallel.chunked_loss import chunk_rows
from lightning_ptdp.parallel.fused_loss import apply_fused_loss, lm_head_path
from lightning_ptdp.parallel.head_logits import HeadLogits, step_outputs

FP32_REL = 1e-5
VOCAB, HIDDEN = 96, 16


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of Liger-Kernel's rule alone: these tiny logits would otherwise be one chunk."""
    monkeypatch.setattr(chunked_loss, "MIN_CHUNK_LOGITS", 0)


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks, an LM head (tied to the embedding when ``tied``)."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, tied: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)) for _ in range(2)
        )
        self.lm_head = nn.Linear(hidden, vocab, bias=bias and not tied)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)  # (B, T, h)
        for block in self.blocks:
            x = x + block(x)
        return self.lm_head(x)  # (B, T, V)


def _transformers(logits, ids):  # ForCausalLMLoss: float, pad-and-shift labels, view(-1, V)
    labels = F.pad(ids, (0, 1), value=-100)[..., 1:].contiguous()
    return F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1).to(logits.device), ignore_index=-100)


def _shifted_smoothed(logits, ids):  # a shift in the step, label smoothing
    logits = logits[:, :-1, :]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), label_smoothing=0.1)


def _litgpt(logits, ids):  # litgpt's chunked_cross_entropy: split rows, per-row losses, own mean
    flat, targets = logits.reshape(-1, logits.size(-1)), ids.reshape(-1)
    parts = [
        F.cross_entropy(a, b, reduction="none", ignore_index=-100) for a, b in zip(flat.split(7), targets.split(7))
    ]
    return torch.cat(parts).sum() / (targets != -100).sum()


def _module_sum_own_ignore(logits, ids):  # nn.CrossEntropyLoss, a sum, another ignore_index
    targets = ids.clamp_min(0).flatten()  # token 5 is the one ignored
    return nn.CrossEntropyLoss(ignore_index=5, reduction="sum")(logits.flatten(0, 1), targets) / targets.numel()


def _masked_rows(logits, ids):  # logits[mask] with a (B, T) mask
    keep = ids != -100
    return F.cross_entropy(logits[keep], ids[keep])


def _weighted_rows(logits, ids):  # per-row losses weighted (reduction="none": recomputed in backward)
    rows = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")
    return (rows * torch.linspace(0.0, 2.0, rows.numel())).mean()


IDIOMS = {
    "transformers": _transformers,
    "shifted_smoothed": _shifted_smoothed,
    "litgpt": _litgpt,
    "module_sum_own_ignore": _module_sum_own_ignore,
    "masked_rows": _masked_rows,
    "weighted_rows": _weighted_rows,
}


def _batch(seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(seed))
    ids[1, -4:] = -100  # padding
    return ids


def _pair(**kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = TinyLM(**kwargs)
    fused = copy.deepcopy(plain)
    apply_fused_loss(fused, lm_head_path(fused))
    return plain, fused


def _loss_and_grads(model: nn.Module, idiom, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = idiom(model(ids.clamp_min(0)), ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_each_loss_idiom_gives_the_unfused_loss_and_gradients(idiom, tied):
    plain, fused = _pair(tied=tied)
    ids = _batch()
    loss, grads = _loss_and_grads(plain, IDIOMS[idiom], ids)
    fused_loss, fused_grads = _loss_and_grads(fused, IDIOMS[idiom], ids)
    assert _relative(fused_loss, loss) <= FP32_REL
    for name, grad in grads.items():
        assert _relative(fused_grads[name], grad) <= FP32_REL, name
    # the oracle can fail: one token's target moved
    other = ids.clone()
    other[0, 3] = (other[0, 3] + 1) % VOCAB
    assert _relative(_loss_and_grads(fused, IDIOMS[idiom], other)[0], loss) > FP32_REL


class _LargestTensor(TorchDispatchMode):
    """The largest tensor any aten op makes (elements; views of its inputs are not made)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in given:  # not a view
                self.largest = max(self.largest, value.numel())
        return out


def test_the_whole_logits_are_never_made():
    vocab = 512  # a chunk of rows: 2 rows' logits, against the whole 48 rows'
    plain, fused = _pair(vocab=vocab)
    ids = torch.randint(0, vocab, (3, 16), generator=torch.Generator().manual_seed(0))
    logits_numel = ids.numel() * vocab
    for model, expect_whole in ((plain, True), (fused, False)):
        with _LargestTensor() as seen:
            F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        assert (seen.largest >= logits_numel) == expect_whole, (seen.largest, logits_numel)
    assert seen.largest <= vocab * HIDDEN  # the weight's gradient is the largest thing left


def test_chunks_hold_about_the_heads_input_and_at_least_a_floor_of_logits():
    assert chunk_rows(8 * 8192, 128256, 4096, least=2**22) == 2048  # Llama-3-8B, 8 x 8192 tokens: 32 chunks
    assert chunk_rows(48, 512, 16, least=0) == 2 and chunk_rows(5, 8, 16, least=0) == 5
    assert chunk_rows(48, 512, 16, least=2**22) == 48  # tiny logits: one chunk


@pytest.mark.parametrize("first_use", ["argmax", "softmax", "pick"])
def test_any_other_use_gets_the_logits_the_head_computes_and_keeps_them(first_use):
    plain, _ = _pair()
    ids = _batch().clamp_min(0)
    fused = copy.deepcopy(plain)
    report = apply_fused_loss(fused, lm_head_path(fused))
    expected, logits = plain(ids), fused(ids)
    assert isinstance(logits, HeadLogits) and logits.shape == expected.shape and logits.dtype == expected.dtype
    uses = {
        "argmax": lambda x: x.argmax(-1),
        "softmax": lambda x: x.softmax(-1),
        "pick": lambda x: x[..., :3],  # picks from the vocabulary
    }
    assert torch.equal(uses[first_use](logits), uses[first_use](expected))
    assert report.uses == [first_use if first_use != "pick" else "__getitem__"]
    # computed once and kept: the loss now runs on those logits, unfused, with the same result
    loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
    assert torch.allclose(loss, F.cross_entropy(expected.flatten(0, 1), ids.flatten()))
    assert "cross_entropy" not in report.uses
    returned = step_outputs(lambda: {"loss": loss, "logits": logits})()
    assert type(returned["logits"]) is torch.Tensor and torch.equal(returned["logits"], logits.computed())


def _softcap(logits, ids):  # Gemma's final logit softcapping, then a cast
    logits = torch.tanh(logits / 3.0) * 3.0
    return F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())


def _logit_scale(logits, ids):  # Cohere's logit_scale, a number
    return F.cross_entropy((logits * 0.0625).flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("idiom", [_softcap, _logit_scale], ids=["softcap", "logit_scale"])
def test_pointwise_steps_after_the_head_run_per_chunk(idiom):
    """A function of the logits and numbers alone, every aten op of it pointwise, stays fused."""
    plain, fused = _pair()
    ids = _batch()
    report = apply_fused_loss(fused, lm_head_path(fused))
    loss, grads = _loss_and_grads(plain, idiom, ids)
    fused_loss, fused_grads = _loss_and_grads(fused, idiom, ids)
    assert report.uses == ["cross_entropy"]
    assert _relative(fused_loss, loss) <= FP32_REL
    for name, grad in grads.items():
        assert _relative(fused_grads[name], grad) <= FP32_REL, name


def test_an_in_place_change_is_kept_and_a_view_taken_before_it_is_refused():
    plain, fused = _pair()
    ids = _batch().clamp_min(0)
    expected, logits = plain(ids), fused(ids)
    logits.mul_(2.0)
    expected.mul_(2.0)
    assert torch.allclose(
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()), F.cross_entropy(expected.flatten(0, 1), ids.flatten())
    )
    logits = fused(ids)
    flat = logits.view(-1, VOCAB)  # a view: in one process it would see the change below
    logits[:, :, 0] = 0.0
    with pytest.raises(RuntimeError, match=r"changed in place \(__setitem__\) after this view"):
        F.cross_entropy(flat, ids.flatten())


def test_logits_read_after_the_weight_changed_are_refused():
    _, fused = _pair()
    logits = fused(_batch().clamp_min(0))
    with torch.no_grad():
        fused.lm_head.weight.add_(1.0)  # an optimizer step
    with pytest.raises(RuntimeError, match="after the LM head's weight changed"):
        logits.argmax(-1)


def _plain(logits, ids):  # no cast: under autocast, cross-entropy itself computes in fp32
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("idiom", [_transformers, _plain], ids=["cast", "no-cast"])
def test_under_autocast_the_logits_and_loss_take_autocasts_dtypes(idiom):
    plain, fused = _pair()
    ids = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, logits = plain(ids.clamp_min(0)), fused(ids.clamp_min(0))
        assert logits.dtype == expected.dtype == torch.bfloat16
        loss, fused_loss = idiom(expected, ids), idiom(logits, ids)
    assert loss.dtype == fused_loss.dtype == torch.float32
    assert _relative(fused_loss, loss) <= 2**-8  # bf16 logits, each row's loss the same ops


def test_fused_loss_must_be_none_or_a_bool():
    with pytest.raises(ValueError, match=r"fused_loss='yes' must be None \(where it applies\), True or False"):
        ParallelConfig(fused_loss="yes")


@pytest.mark.parametrize(
    "shape, local",
    [((-1, 32), (64, 32)), ((-1, 32, 32), (4, 16, 32)), ((4, 32, -1), (4, 16, 32)), ((128, 32), (64, 32))],
    ids=["rows-of-h-equal-to-S", "sequence", "sequence-then-inferred", "all-rows"],
)
def test_a_cut_sequence_view_reads_dim_1_as_the_sequence_only_when_the_tokens_sizes_follow(shape, local):
    """CP's cut tail (4 sequences, this rank's 16 of S = 32 tokens, h = 32): ``view(-1, h)`` makes rows even
    where h equals S (the fused loss views the head's input so), ``view(-1, S, h)`` keeps the sequence."""
    from lightning_ptdp.context_parallel.layout import CPGroup
    from lightning_ptdp.context_parallel.tail import SequenceShard

    cut = SequenceShard.wrap(torch.zeros(4, 16, 32), CPGroup(None, 2, 0), batch=4)
    assert tuple(cut.view(*shape).local().shape) == local


def test_a_random_step_after_the_head_is_not_replayed_per_chunk():
    """Dropout on the logits is no pointwise step (aten tags it nondeterministic_seeded): the logits are
    computed once, as unfused, and the loss runs on them."""
    plain, fused = _pair()
    report = apply_fused_loss(fused, lm_head_path(fused))
    ids = _batch().clamp_min(0)
    losses = []
    for model in (plain, fused):
        torch.manual_seed(0)
        losses.append(F.cross_entropy(F.dropout(model(ids), 0.5).flatten(0, 1), ids.flatten()))
    assert report.uses == ["dropout"]
    assert torch.equal(losses[0], losses[1])


def test_a_second_backward_through_the_loss_gives_its_gradients_again():
    """Zero-bubble pipelines run backward twice through a stage (inputs, then weights): each pass
    must get the loss's gradients, as an unfused loss gives them."""
    plain, fused = _pair()
    ids = _batch()
    grads = []
    for model in (plain, fused):
        model.zero_grad()
        loss = _transformers(model(ids.clamp_min(0)), ids)
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert _relative(grads[1][name], grad) <= FP32_REL, name


def test_under_no_grad_no_gradient_is_made():
    """Validation: the head's weight still requires grad, but no weight-sized gradient may be built."""
    vocab = 512
    _, fused = _pair(vocab=vocab)
    ids = torch.randint(0, vocab, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), _LargestTensor() as seen:
        F.cross_entropy(fused(ids).flatten(0, 1), ids.flatten())
    assert seen.largest < vocab * HIDDEN  # the weight's size: its gradient would be one
