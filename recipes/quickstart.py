"""The main job: train the tiny GPT with strategy="ptdp" on CPU processes, on the embedded corpus.

    python -m recipes.quickstart                 # 2 CPU processes, ~1-2 minutes on 2 cores
    python -m recipes.quickstart --devices 4 --max-steps 500

Lightning's own launcher starts the extra processes (the script re-runs itself once per rank).
At the end rank 0 prints the final losses against the bound the corpus guarantees, and where
the checkpoint and the metrics went.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_ptdp import PTDPStrategy

from .data import MarkovDataModule
from .gpt import GPTConfig, GPTLightningModule, OptimConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (data-parallel ranks)")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=32, help="sequences per optimizer step, all ranks")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/quickstart"))
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.global_batch % args.devices:
        raise SystemExit(f"--global-batch={args.global_batch} is not divisible by --devices={args.devices}")
    L.seed_everything(args.seed, verbose=False)
    data = MarkovDataModule(vocab_size=256, branching=4, seq_length=64, batch_size=args.global_batch // args.devices)
    model = GPTLightningModule(
        GPTConfig(vocab_size=256, seq_length=64, num_layers=2, num_heads=4, hidden_size=64),
        OptimConfig(lr=3e-3, warmup_steps=20, max_steps=args.max_steps),
    )
    checkpoint = ModelCheckpoint(dirpath=args.out_dir / "checkpoints", filename="last", save_top_k=1, monitor=None)
    logger = CSVLogger(save_dir=args.out_dir, name="metrics", version="")
    trainer = L.Trainer(
        strategy=PTDPStrategy(),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.max_steps,
        val_check_interval=max(1, args.max_steps // 3),
        check_val_every_n_epoch=None,
        limit_val_batches=10,
        log_every_n_steps=10,
        logger=logger,
        callbacks=[checkpoint],
        default_root_dir=args.out_dir,
    )
    trainer.fit(model, data)
    dims = trainer.strategy.parallel_dims
    summary = {
        "train_loss": float(trainer.callback_metrics["train_loss"]),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "val_perplexity": float(trainer.callback_metrics["val_perplexity"]),
        "loss_bound": data.loss_bound(),
        "entropy_floor": data.chain.entropy_rate,
        "checkpoint": checkpoint.best_model_path or checkpoint.last_model_path,
        "metrics_csv": str(Path(logger.log_dir) / "metrics.csv"),
        "layout": {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp, "world_size": dims.world_size},
        "steps": trainer.global_step,
    }
    if trainer.is_global_zero:
        learned = "below" if summary["val_loss"] < summary["loss_bound"] else "NOT below"
        print(
            f"\nfinal train loss {summary['train_loss']:.4f}, val loss {summary['val_loss']:.4f} "
            f"({learned} the corpus bound {summary['loss_bound']:.4f}; best possible {summary['entropy_floor']:.4f})"
        )
        print(f"checkpoint: {summary['checkpoint']}\nmetrics:    {summary['metrics_csv']}")
        (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
