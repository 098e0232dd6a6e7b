"""The hydra config tree (conf/) against the paper's Table 1 and the classes it configures.

Composition only (hydra's compose API): no process group, no training.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from lightning_ptdp import ParallelConfig, PTDPStrategy
from lightning_ptdp.planner import GPT3_175B, TABLE_1
from recipes import train
from recipes.gpt import GPTConfig, OptimConfig

CONF = Path(__file__).resolve().parents[2] / "conf"
SIZES = [name.removeprefix("gpt_") for name in TABLE_1]  # Narayanan et al. 2021, Table 1

PARAMETER_RTOL = 0.05
"""Eq. 2 of the paper gives 1.65B for the "1.7B" row; the other rows agree within 1.5%."""


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


def test_every_group_has_its_options():
    assert options("model") == sorted(["tiny", "small", "gpt3_175b", *(f"gpt_{size}" for size in SIZES)])
    assert options("parallel") == sorted(["dp1", "dp2", "dp4", "paper_gpt3_175b", *(f"paper_{size}" for size in SIZES)])
    assert options("trainer") == ["cpu", "gpu"]
    assert options("data") == ["markov", "text", "tokens"]
    assert options("logger") == ["csv", "tensorboard", "wandb"]


def test_defaults_are_the_tiny_cpu_run():
    cfg = compose_config("run_dir=/tmp/unused")
    assert cfg.model.num_layers == 2 and cfg.parallel.data_parallel_size == 2
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 2
    assert cfg.data._target_ == "recipes.data.MarkovDataModule"
    assert cfg.logger._target_.endswith("CSVLogger")
    assert cfg.optim.max_steps == cfg.trainer.max_steps


@pytest.mark.parametrize("size", SIZES)
def test_model_and_layout_match_table_1(size):
    row = TABLE_1[f"gpt_{size}"]
    cfg = compose_config(f"model=gpt_{size}", f"parallel=paper_{size}")
    model = GPTConfig(**train.checked_kwargs(GPTConfig, cfg.model, "model"))
    shape = (model.num_heads, model.hidden_size, model.num_layers, model.vocab_size, model.seq_length)
    assert shape == (row.model.num_heads, row.model.hidden_size, row.model.num_layers, 51200, 2048)
    assert row.model.parameters == pytest.approx(row.parameters_billions * 1e9, rel=PARAMETER_RTOL)
    layout = ParallelConfig(**cfg.parallel)
    assert (layout.tensor_parallel_size, layout.pipeline_parallel_size) == (
        row.tensor_parallel_size,
        row.pipeline_parallel_size,
    )
    # Megatron splits heads across t and layers evenly across p stages.
    assert model.num_heads % layout.tensor_parallel_size == 0
    assert model.num_layers % layout.pipeline_parallel_size == 0


def test_gpt3_175b_model_and_layout():
    cfg = compose_config("model=gpt3_175b", "parallel=paper_gpt3_175b")
    model = GPTConfig(**train.checked_kwargs(GPTConfig, cfg.model, "model"))
    shape = (model.num_heads, model.hidden_size, model.num_layers, model.vocab_size, model.seq_length)
    assert shape == (GPT3_175B.num_heads, GPT3_175B.hidden_size, GPT3_175B.num_layers, 51200, 2048)
    layout = ParallelConfig(**cfg.parallel)
    assert (layout.tensor_parallel_size, layout.pipeline_parallel_size) == (8, 12)  # t*p = 96 (Table 2)


@pytest.mark.parametrize("name", options("parallel"))
def test_parallel_keys_are_exactly_the_strategy_arguments(name):
    """The layout is ParallelConfig, whole; the strategy's other arguments (backend, timeout,
    tp_plan...) are not layout and are added with +parallel.<name>=... when wanted."""
    node = OmegaConf.load(CONF / "parallel" / f"{name}.yaml")
    assert set(node) == {f.name for f in dataclasses.fields(ParallelConfig)}
    assert set(node) <= set(inspect.signature(PTDPStrategy).parameters)
    ParallelConfig(**OmegaConf.to_container(node))


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_cpu_models_build(name):
    cfg = compose_config(f"model={name}", "run_dir=/tmp/unused")
    module = train.build_module(cfg)
    assert module.model_config.num_layers == cfg.model.num_layers
    assert sum(p.numel() for p in module.parameters()) < 2_000_000
    assert module.optim_config == OptimConfig(
        **{**OmegaConf.to_container(cfg.optim, resolve=True), "betas": (0.9, 0.95)}
    )


@pytest.mark.parametrize(
    ("overrides", "devices"),
    [
        (["parallel=dp4"], 4),
        (["parallel=dp1"], 1),
        (["parallel=dp4", "trainer.num_nodes=2"], 2),
        (["parallel=paper_1.7b"], "auto"),
        (["parallel=dp2", "trainer.devices=2"], 2),
    ],
)
def test_devices_follow_the_layout(overrides, devices):
    assert compose_config(*overrides).trainer.devices == devices


def test_layout_that_does_not_split_over_nodes_is_an_error():
    cfg = compose_config("parallel=dp2", "trainer.num_nodes=4")
    with pytest.raises(ValueError, match=r"does not split evenly over trainer.num_nodes=4"):
        _ = cfg.trainer.devices


def test_misspelled_option_lists_the_available_ones():
    with pytest.raises(MissingConfigException, match=r"Could not find 'model/gpt_2t'") as info:
        compose_config("model=gpt_2t")
    assert "gpt_1t" in str(info.value.options)


def test_misspelled_group_or_key_is_refused():
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'modle'"):
        compose_config("modle=tiny")
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'model.num_layer'"):
        compose_config("model.num_layer=3")


def test_added_key_the_dataclass_does_not_take_names_the_valid_keys():
    cfg = compose_config("+model.num_layer=3", "run_dir=/tmp/unused")
    with pytest.raises(ValueError, match=r"model: num_layer is not an argument of GPTConfig; valid keys: .*num_layers"):
        train.build_module(cfg)
    cfg = compose_config("+parallel.tensor_parallel=2", "run_dir=/tmp/unused")
    with pytest.raises(ValueError, match=r"parallel: tensor_parallel is not an argument of PTDPStrategy"):
        train.build_trainer(cfg, logger=False)


def test_data_vocabulary_larger_than_the_model_is_an_error():
    cfg = compose_config("data.vocab_size=512", "data.train_tokens=1000", "data.val_tokens=200", "run_dir=/tmp/x")
    with pytest.raises(ValueError, match=r"token ids below 512, but model.vocab_size=256"):
        train.build_datamodule(cfg)


def test_tensorboard_without_the_package_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(train.importlib.util, "find_spec", lambda name: None)
    cfg = compose_config("logger=tensorboard", f"run_dir={tmp_path}")
    with pytest.raises(ModuleNotFoundError, match=r"needs the tensorboard package.*pip install tensorboard"):
        train.build_logger(cfg)


def test_wandb_logger_is_offline_by_default(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = compose_config("logger=wandb", f"run_dir={tmp_path}")
    logger = train.build_logger(cfg)
    assert type(logger).__name__ == "WandbLogger"
    assert train.os.environ["WANDB_MODE"] == "offline"
    assert logger.save_dir == str(tmp_path)


def test_logger_can_be_removed():
    assert train.build_logger(compose_config("~logger", "run_dir=/tmp/unused")) is False
