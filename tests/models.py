"""A zoo of ordinary models the library must handle without knowing them.

None of these know about parallelism; attribute names differ on purpose (the library must find
structure, not names):
  - nanoGPT style: one fused ``c_attn`` Linear split into q, k, v in forward, the head count read
    from ``self.n_head`` inside ``view``, GeLU MLP ``c_fc``/``c_proj``, LM head tied to ``wte``.
  - Llama style: separate ``wq``/``wk``/``wv``/``wo`` with grouped-query attention, RMSNorm,
    rotary embeddings, SwiGLU MLP ``w1``/``w2``/``w3``, untied ``output`` head.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes.gpt import GPTConfig, GPTLightningModule, OptimConfig, apply_rotary, rotary_tables
from tests.real_models import REAL_FAMILIES


@dataclass(kw_only=True)
class ZooConfig:
    vocab_size: int = 64
    seq_length: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    hidden_size: int = 32
    padding_idx: int | None = None  # of the Llama token embedding (transformers sets it from pad_token_id)
    repeat_from_shapes: bool = False  # Llama's KV repeat count read from the tensors' head dims, not attributes
    flash: bool = True  # nanoGPT's attention: SDPA, or written out with its causal `bias` buffer
    baddbmm: bool = False  # written out: scores as baddbmm(zeros, q, k^T) over heads folded into the batch


class NanoAttention(nn.Module):
    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__()
        self.n_head = cfg.num_heads
        self.n_embd = cfg.hidden_size
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.flash, self.baddbmm = cfg.flash, cfg.baddbmm
        if not self.flash:  # nanoGPT's slow path, as written there
            causal = torch.tril(torch.ones(cfg.seq_length, cfg.seq_length))
            self.register_buffer("bias", causal.view(1, 1, cfg.seq_length, cfg.seq_length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            if self.baddbmm:  # GPT-NeoX-Japanese / BLOOM: the scores' bias is baddbmm's input, heads in the batch
                zeros = torch.zeros(B * self.n_head, T, k.size(-2), dtype=q.dtype)  # (B*nh, T, T)
                folded = q.reshape(B * self.n_head, T, -1), k.reshape(B * self.n_head, -1, C // self.n_head)
                att = torch.baddbmm(zeros, folded[0], folded[1].transpose(1, 2), alpha=1.0 / math.sqrt(k.size(-1)))
                att = att.view(B, self.n_head, T, -1)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoBlock(nn.Module):
    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = NanoAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.c_fc = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.c_proj = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.seq_length, cfg.hidden_size)
        self.h = nn.ModuleList(NanoBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class DocumentAttention(NanoAttention):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # mask: (T, T), True = attend
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class DocumentBlock(NanoBlock):
    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__(cfg)
        self.attn = DocumentAttention(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class PackedDocumentsGPT(NanoGPT):
    """nanoGPT over two documents packed in each sequence: a block-diagonal causal mask (the second
    document starting at 3/8 of the sequence, inside a context-parallel chunk) passed to the blocks."""

    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__(cfg)
        self.h = nn.ModuleList(DocumentBlock(cfg) for _ in range(cfg.num_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        positions = torch.arange(T, device=idx.device)
        document = positions >= 3 * T // 8
        mask = (positions[:, None] >= positions[None, :]) & (document[:, None] == document[None, :])
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.repeat_from_shapes = cfg.repeat_from_shapes
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.wq = nn.Linear(cfg.hidden_size, cfg.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos[:T], sin[:T]), apply_rotary(k, cos[:T], sin[:T])
        repeat = q.shape[1] // k.shape[1] if self.repeat_from_shapes else self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__()
        ffn = 64 * math.ceil(8 * cfg.hidden_size / 3 / 64)
        self.attention_norm = RMSNorm(cfg.hidden_size)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size)
        self.w1 = nn.Linear(cfg.hidden_size, ffn, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, ffn, bias=False)
        self.w2 = nn.Linear(ffn, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEFeedForward(nn.Module):
    """Plain PyTorch mixture of experts: a router Linear, a ModuleList of SwiGLU experts, softmax then
    top-2 with the weights renormalised; an expert no token chose is skipped (not called)."""

    def __init__(self, hidden: int, ffn: int, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, ffn) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (B*T, C)
        weights, chosen = torch.topk(self.gate(x).softmax(dim=-1), self.top_k)  # (B*T, k) each
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(shape)


class MoELlamaBlock(LlamaBlock):
    """The Llama block with its MLP replaced by ``MoEFeedForward`` (4 experts, top-2)."""

    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__(cfg)
        del self.w1, self.w2, self.w3
        self.moe = MoEFeedForward(cfg.hidden_size, 2 * cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.moe(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.padding_idx)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.seq_length, cfg.hidden_size // cfg.num_heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.output(self.norm(x))


class TupleLlamaBlock(LlamaBlock):
    """Returns (activation, None, a tensor the model ignores), as transformers' layers return an
    unrequested attention-weights slot, or eager attention's weights unasked."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        out = super().forward(x, cos, sin)
        return out, None, out.detach().softmax(-1)


class TupleLlama(Llama):
    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(TupleLlamaBlock(cfg) for _ in range(cfg.num_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)[0]
        return self.output(self.norm(x))


class CausalLM(L.LightningModule):
    """An ordinary LightningModule around any token -> logits network, with plain AdamW."""

    def __init__(self, net: nn.Module, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = net
        self.lr = lr

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(self.logits(inputs).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class MoEWithBalancingLoss(CausalLM):
    """A transformers MoE trained with its own load-balancing loss: cross-entropy plus the auxiliary
    loss transformers computes from the router logits of the tokens in this forward (so it depends on
    which tokens share a batch), at weight 1 (the configs' 0.001-0.02 would hide that in round-off)."""

    balancing_weight = 1.0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        model = self.net.model
        out = model(input_ids=inputs, use_cache=False, output_router_logits=True)
        loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
        loss = loss + self.balancing_weight * out.aux_loss
        self.log("train_loss", loss, sync_dist=True)
        return loss


class PaddedCausalLM(CausalLM):
    """A transformers model trained as users fine-tune one on padded batches: each sample's last
    tokens are padding (a different count per sample, from its content), masked out of attention by
    ``attention_mask`` and out of the loss by labels of -100, the loss computed by transformers itself
    (its own label shift and ignore_index mean over the whole batch's real tokens)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, _ = batch
        length = inputs.size(1)
        pads = (inputs[:, 0] * 7) % (length // 2)  # 0 .. length/2 - 1 padding tokens, per sample
        real = torch.arange(length, device=inputs.device)[None, :] < (length - pads)[:, None]
        labels = inputs.masked_fill(~real, -100)
        out = self.net.model(input_ids=inputs, attention_mask=real.long(), labels=labels, use_cache=False)
        self.log("train_loss", out.loss, sync_dist=True)
        return out.loss


class ShiftedCausalLM(CausalLM):
    """The shift written in the step, as many Lightning projects do: logits of every token but the
    last against the next tokens, the batch's own tokens read as targets."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, _ = batch
        logits = self.logits(inputs)[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), inputs[:, 1:].reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss


class SmoothedCausalLM(CausalLM):
    """Label smoothing and ignored targets in the user's own loss: every target on a token divisible
    by 5 is -100, the rest smoothed by 0.1."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        targets = targets.masked_fill(inputs % 5 == 0, -100)
        loss = F.cross_entropy(self.logits(inputs).flatten(0, 1), targets.flatten(), label_smoothing=0.1)
        self.log("train_loss", loss, sync_dist=True)
        return loss


class AccuracyCausalLM(CausalLM):
    """A step that logs its accuracy besides the loss: the logits are read by argmax too."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self.logits(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_accuracy", (logits.argmax(-1) == targets).float().mean(), sync_dist=True)
        return loss


class Wrapper(nn.Module):
    """A network held inside another module with a forward of its own (transformers' CausalLM around
    its base model, a user's wrapper adding options)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids)


class BypassingCausalLM(CausalLM):
    """A step that calls the wrapped network directly, going around the wrapper's forward."""

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net.inner(inputs)


class FlatLlama(CausalLM):
    """The most common Lightning layout: the LightningModule holds its blocks itself
    (``self.layers = nn.ModuleList(...)``), with no network module around them."""

    def __init__(self, cfg: ZooConfig, lr: float = 1e-2) -> None:
        L.LightningModule.__init__(self)
        self.lr = lr
        llama = Llama(cfg)  # the same parameters, held directly
        self.tok_embeddings, self.layers, self.norm, self.output = (
            llama.tok_embeddings,
            llama.layers,
            llama.norm,
            llama.output,
        )
        self.register_buffer("cos", llama.cos, persistent=False)
        self.register_buffer("sin", llama.sin, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.output(self.norm(x))

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self(inputs)


class NanoGPTDict(CausalLM):
    """nanoGPT's own layout on the LightningModule: ``transformer = nn.ModuleDict(wte, wpe, h, ln_f)``
    and ``lm_head`` beside it (untied unless ``tied``)."""

    def __init__(self, cfg: ZooConfig, tied: bool = False, lr: float = 1e-2) -> None:
        L.LightningModule.__init__(self)
        self.lr = lr
        gpt = NanoGPT(cfg)
        self.transformer = nn.ModuleDict({"wte": gpt.wte, "wpe": gpt.wpe, "h": gpt.h, "ln_f": gpt.ln_f})
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if tied:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self(inputs)


class DeferredCausalLM(CausalLM):
    """Builds its network in ``configure_model`` (under ptdp: parameters on the meta device)."""

    def __init__(self, build, lr: float = 1e-2) -> None:
        super().__init__(None, lr)
        self.build = build

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self.build()


TINY = "tiny:"  # "tiny:<model_type>": tests/tiny_configs.py's config of that transformers architecture


def build_model(family: str, **overrides) -> L.LightningModule:
    """A fresh LightningModule of the named family (module-level, so spawned ranks can call it)."""
    if family == "gpt":
        shape = dict(vocab_size=64, seq_length=32, num_layers=2, num_heads=4, hidden_size=32)
        cfg = GPTConfig(**{**shape, **overrides})
        return GPTLightningModule(cfg, OptimConfig(lr=1e-2, warmup_steps=5, max_steps=50))
    if family == "hf_deferred":
        from tests.real_models import hf_config_of

        return DeferredCausalLM(functools.partial(hf_config_of, **overrides))
    if family == "hf_llama_shifted":
        return ShiftedCausalLM(REAL_FAMILIES["hf_llama"](**overrides))
    if family == "hf_llama_padded":
        return PaddedCausalLM(REAL_FAMILIES["hf_llama"](**overrides))
    if family == "hf_llama_smoothed":
        return SmoothedCausalLM(REAL_FAMILIES["hf_llama"](**overrides))
    if family == "hf_llama_accuracy":
        return AccuracyCausalLM(REAL_FAMILIES["hf_llama"](**overrides))
    if family == "hf_mixtral_balanced":
        return MoEWithBalancingLoss(REAL_FAMILIES["hf_mixtral"](**overrides))
    if family in REAL_FAMILIES:
        return CausalLM(REAL_FAMILIES[family](**overrides))
    if family.startswith(TINY):  # any transformers causal LM at a tiny config (benchmarks/sweep_transformers.py)
        from tests.tiny_configs import build_tiny

        return CausalLM(build_tiny(family.removeprefix(TINY), **overrides))
    if family.startswith("hfplan_"):  # raw transformers models, for explicit-plan paths
        from tests.hf_models import build_hf_model

        return build_hf_model(family, **overrides)
    cfg = ZooConfig(**overrides)
    if family == "nanogpt":
        return CausalLM(NanoGPT(cfg))
    if family == "nanogpt_documents":
        return CausalLM(PackedDocumentsGPT(cfg))
    if family == "nanogpt_eager":
        return CausalLM(NanoGPT(dataclasses.replace(cfg, flash=False)))
    if family == "nanogpt_baddbmm":
        return CausalLM(NanoGPT(dataclasses.replace(cfg, flash=False, baddbmm=True)))
    if family == "llama":
        return CausalLM(Llama(cfg))
    if family == "moe_llama":
        net = Llama(cfg)
        net.layers = nn.ModuleList(MoELlamaBlock(cfg) for _ in range(cfg.num_layers))
        return CausalLM(net)
    if family == "tuple_llama":
        return CausalLM(TupleLlama(cfg))
    if family == "flat_llama":
        return FlatLlama(cfg)
    if family == "nanogpt_bypassed":
        return BypassingCausalLM(Wrapper(NanoGPT(cfg)))
    if family in ("nanogpt_dict", "nanogpt_dict_tied"):
        return NanoGPTDict(cfg, tied=family.endswith("tied"))
    raise ValueError(
        f"unknown model family {family!r}: use 'gpt', 'nanogpt', 'llama', 'flat_llama', 'nanogpt_dict' "
        f"or one of {sorted(REAL_FAMILIES)}"
    )
