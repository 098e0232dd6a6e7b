"""Tiny Hugging Face transformers models in plain LightningModules (fp32, no dropout), for the
explicit-plan tests: GPT-2 (Conv1D layers, tied LM head) and Llama with tied embeddings."""

from __future__ import annotations

import torch

from tests.models import CausalLM


class HFCausalLM(CausalLM):
    """``loss="own"``: F.cross_entropy on ``outputs.logits`` (the LightningModule's loss);
    ``loss="labels"``: the model's own loss from ``labels=inputs`` (transformers' ForCausalLMLoss
    shifts them: every position but the last predicts the next input token)."""

    def __init__(self, net: torch.nn.Module, loss: str = "own") -> None:
        super().__init__(net)
        self.loss_source = loss

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=inputs).logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.loss_source == "own":
            return super().training_step(batch, batch_idx)
        inputs, _ = batch
        loss = self.net(input_ids=inputs, labels=inputs).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss


def build_hf_model(family: str, vocab_size: int = 64, seq_length: int = 32) -> CausalLM:
    import transformers

    if family == "hfplan_gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab_size,
            n_positions=seq_length,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation="sdpa",
        )
        return HFCausalLM(transformers.GPT2LMHeadModel(config))
    if family in ("hfplan_llama_tied", "hfplan_llama_tied_labels"):
        config = transformers.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=seq_length,
            tie_word_embeddings=True,
            attn_implementation="sdpa",
        )
        return HFCausalLM(transformers.LlamaForCausalLM(config), loss="labels" if family.endswith("labels") else "own")
    raise ValueError(f"unknown transformers family {family!r}")
