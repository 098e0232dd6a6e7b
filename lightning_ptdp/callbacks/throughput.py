"""PTDPThroughput: tokens/s, samples/s, TFLOP/s per device and MFU from the paper's formulas."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_ptdp.core.flops import device_peak_flops, gpt_flops_per_iteration

_FORMULAS = {
    True: "F = 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) (Narayanan et al. 2021 Eq. 3: the recomputed "
    "forward is counted, as the paper does)",
    False: "F = 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) (model FLOPs: forward + backward, no recompute)",
}


def batch_shape(batch: Any) -> tuple[int, int]:
    """(sequences, tokens per sequence) of a batch: the first tensor with two or more dimensions,
    searched through tuples, lists and dict values in order (e.g. the input ids of (inputs, targets))."""
    if isinstance(batch, torch.Tensor) and batch.dim() >= 2:
        return int(batch.shape[0]), int(batch.shape[1])
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        try:
            return batch_shape(item)
        except ValueError:
            continue
    raise ValueError(
        f"PTDPThroughput found no (batch, sequence) tensor in a batch of type {type(batch).__name__}; "
        "pass PTDPThroughput(batch_shape_fn=lambda batch: (sequences, tokens_per_sequence))"
    )


class PTDPThroughput(pl.Callback):
    """Log tokens/s, samples/s, TFLOP/s per device and MFU every ``log_every_n_steps`` batches.

    Per window of ``n`` training batches, with ``t`` the wall-clock seconds those batches took
    (validation excluded; data loading, forward, backward, optimizer and other callbacks included):

    * tokens/s = ``n * B * s / t`` and samples/s = ``n * B / t``, where ``B`` is the **global**
      batch: the per-rank batch ``(B_local, s)`` times the data-parallel size (the strategy's
      ``distributed_sampler_kwargs["num_replicas"]``, else the world size);
    * TFLOP/s per device = ``n * F(B, s) / t / devices / 1e12`` with ``devices`` the world size
      (every t, p and d rank) and ``F`` from :func:`lightning_ptdp.core.flops.gpt_flops_per_iteration`:
      with ``activation_recompute=True``, the paper's Eq. 3
      ``F = 96Bslh^2 (1 + s/(6h) + V/(16lh))``; without, the model FLOPs
      ``F = 72Bslh^2 (1 + s/(6h) + V/(12lh))``;
    * MFU = TFLOP/s per device * 1e12 / peak FLOP/s of one device. With the recompute formula
      this is the paper's "percentage of peak"; without, it is MFU in the PaLM sense.

    ``num_layers``, ``hidden_size`` and ``vocab_size`` come from the arguments or else from the
    LightningModule's ``model_config`` (as ``recipes.gpt.GPTLightningModule`` has); ``s`` is the
    batch's second dimension unless ``seq_length`` is given. ``activation_recompute=None`` takes
    it from the strategy: True for ``PTDPStrategy(activation_checkpointing="full")``, else False
    (selective recompute's extra attention-core work is not counted). The peak is
    ``peak_flops`` if given, else looked up for the CUDA device and the Trainer's precision; on
    CPU, or on a GPU the table does not know, MFU is skipped (said once) and the rest is logged.
    Metrics go to every logger, to ``trainer.callback_metrics`` and (``prog_bar=True``) to the
    progress bar as ``throughput/<name>``; the formula is logged as the hyperparameter
    ``throughput/flops_formula`` and kept in ``self.flops_formula``.
    """

    def __init__(
        self,
        *,
        log_every_n_steps: int = 10,
        num_layers: Optional[int] = None,
        hidden_size: Optional[int] = None,
        vocab_size: Optional[int] = None,
        seq_length: Optional[int] = None,
        activation_recompute: Optional[bool] = None,
        peak_flops: Optional[float] = None,
        prog_bar: bool = True,
        batch_shape_fn: Optional[Callable[[Any], tuple[int, int]]] = None,
    ) -> None:
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"PTDPThroughput(log_every_n_steps={log_every_n_steps!r}) must be a positive integer")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(
                f"PTDPThroughput(peak_flops={peak_flops!r}) must be a positive FLOP/s value, "
                "e.g. 989e12 for an H100 SXM in bf16"
            )
        self.log_every_n_steps = log_every_n_steps
        self._given_dims = {"num_layers": num_layers, "hidden_size": hidden_size, "vocab_size": vocab_size}
        self.seq_length, self.activation_recompute = seq_length, activation_recompute
        self.peak_flops, self.prog_bar = peak_flops, prog_bar
        self.batch_shape_fn = batch_shape_fn or batch_shape
        self.dims: dict[str, int] = {}
        self.flops_formula = ""
        self.last_metrics: dict[str, float] = {}
        self.last_window: dict[str, float] = {}
        self.data_parallel_size = 1
        self.device_peak_flops: Optional[float] = None
        self._reset_window()
        self._segment_start: Optional[float] = None

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Called on every rank before the model is set up: resolve the model's dimensions."""
        if stage == "fit":
            self.dims = self._model_dims(pl_module)

    def _model_dims(self, pl_module: pl.LightningModule) -> dict[str, int]:
        config = getattr(pl_module, "model_config", None)
        dims = {
            name: value if value is not None else getattr(config, name, None)
            for name, value in self._given_dims.items()
        }
        missing = [name for name, value in dims.items() if value is None]
        if missing:
            raise ValueError(
                f"PTDPThroughput needs the model's {', '.join(missing)} for the FLOPs count: pass "
                f"PTDPThroughput({', '.join(f'{name}=...' for name in missing)}), or give "
                f"{type(pl_module).__name__} a `model_config` with those fields"
            )
        return dims

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Called after the strategy set up the model: data-parallel size, peak, formula."""
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        self.data_parallel_size = int(kwargs.get("num_replicas", trainer.world_size))
        if self.activation_recompute is None:
            config = getattr(trainer.strategy, "parallel_config", None)
            self.activation_recompute = getattr(config, "activation_checkpointing", None) == "full"
        self.device_peak_flops = self._resolve_peak(trainer, pl_module.device)
        self.flops_formula = (
            f"{_FORMULAS[self.activation_recompute]} with l={self.dims['num_layers']}, "
            f"h={self.dims['hidden_size']}, V={self.dims['vocab_size']}, B = per-rank batch x "
            f"{self.data_parallel_size} data-parallel replicas; TFLOP/s per device = F / step time / "
            f"{trainer.world_size} devices / 1e12; MFU = TFLOP/s per device * 1e12 / peak "
            f"({'not known' if self.device_peak_flops is None else f'{self.device_peak_flops:.4g}'} FLOP/s)"
        )
        rank_zero_info(f"PTDPThroughput: {self.flops_formula}")
        for logger in trainer.loggers:
            logger.log_hyperparams({"throughput/flops_formula": self.flops_formula})

    def _resolve_peak(self, trainer: pl.Trainer, device: torch.device) -> Optional[float]:
        if self.peak_flops is not None:
            return float(self.peak_flops)
        if device.type != "cuda":
            rank_zero_info(
                f"PTDPThroughput: MFU is not logged on {device.type} (no peak known); pass "
                "PTDPThroughput(peak_flops=...) in FLOP/s to log it"
            )
            return None
        name = torch.cuda.get_device_name(device)
        try:
            return device_peak_flops(name, dtype=str(trainer.precision))
        except ValueError as err:
            rank_zero_info(f"PTDPThroughput: MFU is not logged: {err}")
            return None

    # ------------------------------------------------------------------ timing
    def _now(self, device: torch.device) -> float:
        if device.type == "cuda":  # only at window edges: the batches in between run asynchronously
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _reset_window(self) -> None:
        self._elapsed, self._batches, self._samples, self._tokens, self._flops = 0.0, 0, 0, 0, 0

    def _close_segment(self, device: torch.device) -> float:
        now = self._now(device)
        if self._segment_start is not None:
            self._elapsed += now - self._segment_start
            self._segment_start = None
        return now

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._segment_start = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Validation inside a training epoch is not training time: pause the clock."""
        self._close_segment(pl_module.device)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._segment_start is None:
            self._segment_start = self._now(pl_module.device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        sequences, tokens_per_sequence = self.batch_shape_fn(batch)
        global_sequences = sequences * self.data_parallel_size
        self._batches += 1
        self._samples += global_sequences
        self._tokens += global_sequences * tokens_per_sequence
        self._flops += gpt_flops_per_iteration(
            batch_size=global_sequences,
            seq_length=self.seq_length or tokens_per_sequence,
            num_layers=self.dims["num_layers"],
            hidden_size=self.dims["hidden_size"],
            vocab_size=self.dims["vocab_size"],
            activation_recompute=self.activation_recompute,
        )
        if self._batches < self.log_every_n_steps:
            return
        window_end = self._close_segment(pl_module.device)
        self._log(trainer, pl_module, self._compute(trainer.world_size))
        self._reset_window()
        self._segment_start = window_end  # windows abut: this logging is in the next one

    # ------------------------------------------------------------------ metrics
    def _compute(self, devices: int) -> dict[str, float]:
        seconds = max(self._elapsed, 1e-9)
        metrics = {
            "tokens_per_sec": self._tokens / seconds,
            "samples_per_sec": self._samples / seconds,
            "tflops_per_device": self._flops / seconds / devices / 1e12,
        }
        if self.device_peak_flops is not None:
            metrics["mfu"] = metrics["tflops_per_device"] * 1e12 / self.device_peak_flops
        self.last_window = {
            "seconds": self._elapsed,
            "batches": self._batches,
            "samples": self._samples,
            "tokens": self._tokens,
            "flops": self._flops,
            "devices": devices,
        }
        return metrics

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, metrics: dict[str, float]) -> None:
        self.last_metrics = metrics
        named = {f"throughput/{name}": value for name, value in metrics.items()}
        for logger in trainer.loggers:
            logger.log_metrics(named, step=trainer.global_step)
        for name, value in named.items():
            pl_module.log(name, value, prog_bar=self.prog_bar, logger=False, on_step=True, on_epoch=False)
