"""Hydra recipe: train any GPT size of conf/ with PTDPStrategy.

    python -m recipes.train                                      # tiny GPT, 2 CPU processes, CSV metrics
    python -m recipes.train model=small parallel=dp4 trainer.max_steps=500
    python -m recipes.train model=gpt_1.7b parallel=paper_1.7b trainer=gpu optim=adamw_large
    python -m recipes.train model=gpt_1t parallel=paper_1t --cfg job    # print the composed config
    python -m recipes.train -m parallel=dp1,dp2 trainer.max_steps=50    # a sweep, one job after another
    python -m recipes.train logger=wandb                         # offline W&B run under the run dir

The groups and their options are in conf/ (``python -m recipes.train --help`` lists them).
Every group is checked against the class it configures before anything is built: a key that
``GPTConfig``, ``OptimConfig``, ``PTDPStrategy`` or ``Trainer`` does not take is an error that
names the group and the valid keys. Rank 0 prints the final losses and writes
``<run_dir>/summary.json``.

torch, Lightning and wandb are imported inside the functions, so ``--cfg``, ``--help`` and
hydra's composition errors answer in a second.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write

LOGGER_PACKAGES: dict[str, tuple[str, ...]] = {
    "TensorBoardLogger": ("tensorboard", "tensorboardX"),
    "WandbLogger": ("wandb",),
}
"""Logger class -> packages of which one must be importable."""

_HYDRA_VALUE_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
_PER_JOB_HYDRA_KEYS = ("hydra.mode", "hydra.sweep", "hydra.run.dir", "hydra.job.name", "hydra.output_subdir")


def devices_for_layout(t: int, p: int, d: Union[int, str], num_nodes: int, c: int = 1) -> Union[int, str]:
    """Processes per node for a (t, p, d, c) layout: t*p*d*c / num_nodes, or "auto" when d is "auto"."""
    if d == "auto":
        return "auto"
    world_size = int(t) * int(p) * int(d) * int(c)
    if world_size % int(num_nodes):
        cp = f" x c={c}" if int(c) > 1 else ""
        raise ValueError(
            f"the layout t={t} x p={p} x d={d}{cp} = {world_size} processes does not split evenly over "
            f"trainer.num_nodes={num_nodes}; change data_parallel_size or set trainer.devices explicitly"
        )
    return world_size // int(num_nodes)


OmegaConf.register_new_resolver("ptdp_devices", devices_for_layout, replace=True)


DEFERRED_INIT_PARAMS = 100_000_000


def checked_kwargs(target: Callable, node: Any, group: str) -> dict[str, Any]:
    """The config group as keyword arguments of ``target``; unknown keys name the valid ones."""
    kwargs = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    accepted = set(inspect.signature(target).parameters)
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(
            f"{group}: {', '.join(unknown)} {'is not an argument' if len(unknown) == 1 else 'are not arguments'} "
            f"of {target.__qualname__}; valid keys: {', '.join(sorted(accepted))}"
        )
    return kwargs


def build_module(cfg: DictConfig):
    """The reference GPT from ``cfg.model`` (GPTConfig) and ``cfg.optim`` (OptimConfig)."""
    from .gpt import GPTConfig, GPTLightningModule, OptimConfig

    optim = checked_kwargs(OptimConfig, cfg.optim, "optim")
    optim["betas"] = tuple(optim["betas"])
    model = GPTConfig(**checked_kwargs(GPTConfig, cfg.model, "model"))
    # above ~1e8 parameters build in configure_model: under ptdp on the meta device, then each
    # rank materialises only its shards (no rank ever holds the whole model)
    deferred = (
        12 * model.num_layers * model.hidden_size**2 + model.vocab_size * model.hidden_size > DEFERRED_INIT_PARAMS
    )
    return GPTLightningModule(model, OptimConfig(**optim), deferred_init=deferred)


def build_datamodule(cfg: DictConfig):
    """``cfg.data`` names its class in ``_target_``; its vocabulary must fit the model's."""
    datamodule = hydra.utils.instantiate(cfg.data)
    if datamodule.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"data={_choice('data')} yields token ids below {datamodule.vocab_size}, but model.vocab_size="
            f"{cfg.model.vocab_size}; pick a model with a vocabulary at least that large or set model.vocab_size"
        )
    return datamodule


def build_logger(cfg: DictConfig):
    """The logger of ``cfg.logger`` (False when the group was removed with ``~logger``)."""
    if cfg.get("logger") is None:
        return False
    class_name = str(cfg.logger._target_).rsplit(".", 1)[-1]
    packages = LOGGER_PACKAGES.get(class_name, ())
    if packages and not any(importlib.util.find_spec(name) for name in packages):
        raise ModuleNotFoundError(
            f"logger={_choice('logger')} needs the {packages[0]} package, which is not installed: "
            f"`pip install {packages[0]}`, or choose logger=csv"
        )
    if class_name == "WandbLogger" and cfg.logger.get("offline", False):
        os.environ.setdefault("WANDB_MODE", "offline")
    return hydra.utils.instantiate(cfg.logger)


def build_trainer(cfg: DictConfig, logger: Any):
    """A Trainer with ``PTDPStrategy(**cfg.parallel)`` and ``cfg.trainer`` as its arguments."""
    import lightning as L

    from lightning_ptdp import PTDPStrategy

    strategy = PTDPStrategy(**checked_kwargs(PTDPStrategy, cfg.parallel, "parallel"))
    return L.Trainer(strategy=strategy, logger=logger, **checked_kwargs(L.Trainer, cfg.trainer, "trainer"))


def _choice(group: str) -> str:
    """The option picked for a config group ("tiny", "wandb"...), for error messages."""
    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.choices.get(group, group))
    return group


def prepare_relaunch_from_sweep() -> None:
    """Make Lightning's launcher re-run *this job* of a sweep, not the whole sweep.

    Lightning starts local ranks 1.. by re-running ``sys.argv`` plus ``hydra.run.dir=<run.dir>``.
    Under ``-m`` that command would start the sweep again in every child, in the wrong folder.
    So the command line becomes this job's own overrides, and run.dir this job's output folder.
    """
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    hydra_cfg = HydraConfig.get()
    config_flags, args = [], iter(sys.argv[1:])
    for arg in args:
        if arg in _HYDRA_VALUE_FLAGS:
            config_flags += [arg, next(args, "")]
        elif arg.startswith(tuple(f"{flag}=" for flag in _HYDRA_VALUE_FLAGS)):
            config_flags.append(arg)
    hydra_overrides = [o for o in hydra_cfg.overrides.hydra if not o.startswith(_PER_JOB_HYDRA_KEYS)]
    sys.argv[1:] = [*config_flags, *hydra_overrides, *hydra_cfg.overrides.task]
    with read_write(hydra_cfg):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir


@contextlib.contextmanager
def distributed_job() -> Iterator[None]:
    """Leave the process as it was found, so the next job of a sweep can start its own world:
    Lightning's launcher sets MASTER_PORT, LOCAL_RANK, WORLD_SIZE... in ``os.environ``, and a
    leftover LOCAL_RANK would make the next job believe its processes already exist."""
    import torch.distributed as dist

    environ = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def summarize(trainer, datamodule) -> dict[str, Any]:
    """Final metrics and the layout, identical on every rank (the metrics are synced over dp)."""
    dims = trainer.strategy.parallel_dims
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("train_loss", "val_loss")}
    summary: dict[str, Any] = {
        **metrics,
        "steps": trainer.global_step,
        "layout": {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp, "world_size": dims.world_size},
        "num_nodes": trainer.num_nodes,
        "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
    }
    if hasattr(datamodule, "loss_bound"):
        summary["loss_bound"] = datamodule.loss_bound()
    return summary


def train(cfg: DictConfig) -> dict[str, Any]:
    """Build everything from ``cfg``, fit, report; returns the summary (on every rank)."""
    import lightning as L

    L.seed_everything(cfg.seed, verbose=False)
    module = build_module(cfg)
    datamodule = build_datamodule(cfg)
    logger = build_logger(cfg)
    trainer = build_trainer(cfg, logger)
    if logger:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    prepare_relaunch_from_sweep()
    with distributed_job():
        trainer.fit(module, datamodule)
        summary = summarize(trainer, datamodule)
        if cfg.save_checkpoint:
            summary["checkpoint"] = str(Path(cfg.run_dir, "checkpoints", "last.ckpt"))
            trainer.save_checkpoint(summary["checkpoint"])
    if trainer.is_global_zero:
        losses = ", ".join(f"{k} {v:.4f}" for k, v in summary.items() if k.endswith("_loss"))
        print(f"final {losses} after {summary['steps']} steps on layout {summary['layout']}")
        Path(cfg.run_dir, "summary.json").write_text(json.dumps(summary, indent=2))
    if type(logger).__name__ == "WandbLogger":
        import wandb

        wandb.finish()
    return summary


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> float:
    """Hydra entry point; returns the final training loss (the value a sweeper optimises)."""
    return train(cfg).get("train_loss", float("nan"))


if __name__ == "__main__":
    main()
