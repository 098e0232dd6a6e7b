"""The bad-input table: every strategy argument, recipe field and callback argument with an invalid
value (wrong type, out of range, inconsistent combination) raises one clear error naming the
value and the rule, in the launching process, before any worker starts. Errors that need the
data (batch versus micro_batch_size) or the model (layers versus p*v) are in test_pipeline*.py."""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest

from lightning_ptdp import PTDPStrategy
from lightning_ptdp.callbacks import PipelineTimeline, PTDPThroughput, ReplicaConsistency, StragglerDetector
from recipes.data import MarkovDataModule
from recipes.gpt import GPTConfig, OptimConfig

# (what, keyword arguments, message pattern)
STRATEGY = [
    ({"tensor_parallel_size": 0}, r"tensor_parallel_size=0 must be >= 1; use 1 to switch"),
    (
        {"tensor_parallel_size": 2.0},
        r"tensor_parallel_size=2.0 must be a positive integer, got float; did you mean tensor_parallel_size=2",
    ),
    ({"pipeline_parallel_size": "2"}, r"pipeline_parallel_size='2' must be a positive integer, got str"),
    ({"expert_parallel_size": 0}, r"expert_parallel_size=0 must be >= 1"),
    ({"context_parallel_size": 1.5}, r"context_parallel_size=1.5 must be a positive integer, got float"),
    ({"data_parallel_size": "all"}, r"data_parallel_size='all' must be a positive integer"),
    ({"data_parallel_size": 0}, r"data_parallel_size=0 must be >= 1"),
    ({"virtual_pipeline_size": -1}, r"virtual_pipeline_size=-1 must be >= 1"),
    ({"micro_batch_size": 0}, r"micro_batch_size=0 must be >= 1"),
    ({"micro_batch_size": True}, r"micro_batch_size=True must be a positive integer, got bool"),
    ({"sequence_parallel": 1}, r"sequence_parallel=1 must be True or False"),
    ({"strict_plan": "yes"}, r"strict_plan='yes' must be True or False"),
    ({"certify_plan": None}, r"certify_plan=None must be True or False"),
    ({"overlap_grad_reduce": "yes"}, r"overlap_grad_reduce='yes' must be True or False"),
    ({"zero_stage": 4}, r"zero_stage=4 is not one of 0, 1, 2, 3"),
    ({"data_parallel_shard_size": 0}, r"data_parallel_shard_size=0 must be >= 1"),
    ({"data_parallel_shard_size": 2}, r"data_parallel_shard_size=2 .*needs zero_stage 2 or 3, not 0; set zero_stage=3"),
    (
        {"data_parallel_shard_size": 2, "zero_stage": 3, "expert_parallel_size": 2},
        r"data_parallel_shard_size=2 with expert_parallel_size=2 is not supported yet",
    ),
    ({"float8": "fp8"}, r"float8='fp8' is not one of 'tensorwise', 'rowwise'; choose one of those"),
    (
        {"expert_capacity_factor": 1.0},
        r"expert_capacity_factor=1.0 needs expert_parallel_size > 1: ptdp drops the rows past capacity",
    ),
    (
        {"expert_balance": {"interval": 10}},
        r"expert_balance=.*interval=10.* needs expert_parallel_size > 1: it places \(and replicates\) experts",
    ),
    ({"fused_loss": "yes"}, r"fused_loss='yes' must be None \(where it applies\), True or False"),
    ({"activation_checkpointing": "all"}, r"activation_checkpointing='all' is not one of"),
    (
        {"pipeline_schedule": "interleaved"},
        r"pipeline_schedule='interleaved' is not one of 'interleaved_1f1b', '1f1b', 'gpipe', 'zero_bubble'",
    ),
    ({"kernels": "cuda"}, r"kernels='cuda' is not one of 'auto', 'triton', 'torch'"),
    ({"compile": "yes"}, r"compile='yes' must be True, False, a dict of torch.compile arguments or a CompileConfig"),
    ({"compile": {"backend": "inductor", "options": {}}}, r"unknown keys \['options'\]; ptdp passes backend, mode"),
    (
        {"compile": {"mode": "reduce-overhead"}},
        r"mode='reduce-overhead' records CUDA graphs.*use mode='max-autotune-no",
    ),
    ({"compile": {"mode": "fast"}}, r"compile mode='fast' is not one of None, 'default', 'max-autotune-no-cudagraphs'"),
    ({"compile": {"fullgraph": 1}}, r"compile fullgraph=1 must be True or False"),
    ({"compile": {"backend": ""}}, r"compile backend='' must be the name of a torch.compile backend"),
    ({"compile": {"backend": "tvm2"}}, r"compile backend='tvm2' is not a torch.compile backend on this machine"),
    ({"compile": True, "kernels": "triton"}, r"kernels='triton' with compile: .* use kernels='auto'"),
    (
        {"pretrained": "/no/such/checkpoint"},
        r"pretrained='/no/such/checkpoint' does not exist; give a \.safetensors file",
    ),
    ({"pretrained": ".", "pretrained_prefix": 3}, r"pretrained_prefix=3 must be a string such as 'net\.'"),
    (
        {"tp_plan": {"blocks.0.q": "columnwise"}},
        r"tp_plan\['blocks.0.q'\]='columnwise' is not a style: use one of 'colwise', 'rowwise'",
    ),
    ({"tp_plan": ["blocks.0.q"]}, r"tp_plan=\['blocks.0.q'\] must be a dict of module path -> style"),
    (
        {"expert_parallel_size": 2, "ep_plan": {"blocks.*.moe": "moe"}},
        r"ep_plan=\{'blocks.\*.moe': 'moe'\} must be a dict of module path \(or glob\) -> one of 'experts'",
    ),
    ({"ep_plan": {"blocks.*.moe": "experts"}}, r"ep_plan names modules for expert parallelism: set expert_parallel"),
    ({"on_nonfinite": "stop"}, r"on_nonfinite='stop' is not one of 'raise', 'skip', 'ignore'"),
    ({"checkpoint_format": "dcp"}, r"checkpoint_format='dcp' is not one of 'sharded' \(each rank writes its pieces"),
    ({"process_group_backend": "nccl2"}, r"process_group_backend='nccl2' is not one of 'gloo', 'nccl'"),
    ({"timeout": 30}, r"timeout=30 must be a datetime.timedelta \(e.g. timedelta\(minutes=10\)\) or None"),
    ({"timeout": timedelta(seconds=0)}, r"timeout=0:00:00 must be positive"),
    ({"failure_timeout": 10}, r"failure_timeout=10 must be a datetime.timedelta \(e.g. timedelta\(seconds=10\)\)"),
    (
        {"failure_timeout": timedelta(seconds=-1)},
        r"failure_timeout=-1 day, 23:59:59 must be positive; it bounds how long",
    ),
    ({"start_method": "thread"}, r"start_method='thread' must be 'popen', 'spawn', 'fork' or 'forkserver'"),
    # inconsistent combinations
    ({"sequence_parallel": True}, r"sequence_parallel=True needs tensor_parallel_size > 1"),
    ({"virtual_pipeline_size": 2}, r"virtual_pipeline_size=2 needs pipeline_parallel_size > 1"),
    (
        {"virtual_pipeline_size": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "1f1b"},
        r"pipeline_schedule='1f1b' runs one; use 'interleaved_1f1b'",
    ),
    (
        {"tensor_parallel_size": 2, "sequence_parallel": True, "tp_plan": {"blocks.0.q": "colwise"}},
        r"sequence_parallel=True needs the discovered plan; drop tp_plan or sequence_parallel",
    ),
    (
        {"tp_plan": {"blocks.0.q": "colwise"}},
        r"tp_plan is given but tensor_parallel_size=1; set tensor_parallel_size > 1",
    ),
    (
        {"pipeline_parallel_size": 2, "pipeline_schedule": "zero_bubble", "zero_stage": 2},
        r"pipeline_schedule='zero_bubble' with zero_stage=2 is not supported yet",
    ),
]
LIGHTNING_PLUMBING = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}

RECIPES = [
    (GPTConfig, {"vocab_size": 0}, r"GPTConfig.vocab_size=0 must be a positive integer"),
    (GPTConfig, {"seq_length": 1.5}, r"GPTConfig.seq_length=1.5 must be a positive integer"),
    (GPTConfig, {"num_layers": -1}, r"GPTConfig.num_layers=-1 must be a positive integer"),
    (GPTConfig, {"num_heads": 0}, r"GPTConfig.num_heads=0 must be a positive integer"),
    (GPTConfig, {"hidden_size": 66, "num_heads": 4}, r"GPTConfig.hidden_size=66 is not divisible by num_heads=4"),
    (GPTConfig, {"ffn_hidden_size": 0}, r"GPTConfig.ffn_hidden_size=0 must be a positive integer"),
    (GPTConfig, {"dropout": 1.0}, r"GPTConfig.dropout=1.0 must be in \[0, 1\)"),
    (GPTConfig, {"position_embedding": "alibi"}, r"GPTConfig.position_embedding='alibi': use 'learned' or 'rotary'"),
    (
        GPTConfig,
        {"position_embedding": "rotary", "hidden_size": 12, "num_heads": 4},
        r"rotary position embedding needs an even head size",
    ),
    (GPTConfig, {"tie_embeddings": "yes"}, r"GPTConfig.tie_embeddings='yes' must be True or False"),
    (GPTConfig, {"init_std": 0}, r"GPTConfig.init_std=0 must be a number in \(0.0, inf\)"),
    (GPTConfig, {"init_seed": "7"}, r"GPTConfig.init_seed='7' must be an integer or None"),
    (OptimConfig, {"lr": -1e-3}, r"OptimConfig.lr=-0.001 must be a number in \(0.0, inf\)"),
    (OptimConfig, {"weight_decay": -0.1}, r"OptimConfig.weight_decay=-0.1 must be a number in \[0.0, inf\)"),
    (OptimConfig, {"betas": (0.9,)}, r"OptimConfig.betas=\(0.9,\) must be two numbers"),
    (OptimConfig, {"betas": (0.9, 1.0)}, r"OptimConfig.betas\[1\]=1.0 must be a number in \[0.0, 1.0\)"),
    (OptimConfig, {"warmup_steps": -5}, r"OptimConfig.warmup_steps=-5 must be an integer >= 0"),
    (OptimConfig, {"max_steps": 0}, r"OptimConfig.max_steps=0 must be an integer >= 1"),
    (OptimConfig, {"min_lr_ratio": 1.5}, r"OptimConfig.min_lr_ratio=1.5 must be a number in \[0.0, 1.0\]"),
    (
        MarkovDataModule,
        {"seq_length": 64, "train_tokens": 32},
        r"MarkovDataModule\(train_tokens=32\) is shorter than seq_length \+ 1 = 65; raise train_tokens or lower seq_length",
    ),
]

CALLBACKS = [
    (PipelineTimeline, {"step": -1}, r"PipelineTimeline\(step=-1\) must be >= 0"),
    (ReplicaConsistency, {"every_n_steps": 0}, r"ReplicaConsistency\(every_n_steps=0\) must be a positive integer"),
    (
        ReplicaConsistency,
        {"on_divergence": "log"},
        r"ReplicaConsistency\(on_divergence='log'\) must be 'raise' or 'warn'",
    ),
    (StragglerDetector, {"every_n_steps": 0}, r"StragglerDetector\(every_n_steps=0\) must be a positive integer"),
    (StragglerDetector, {"slowdown_factor": 1.0}, r"StragglerDetector\(slowdown_factor=1.0\) must be a number > 1"),
    (PTDPThroughput, {"log_every_n_steps": 0}, r"PTDPThroughput\(log_every_n_steps=0\) must be a positive integer"),
    (PTDPThroughput, {"peak_flops": -1.0}, r"PTDPThroughput\(peak_flops=-1.0\) must be a positive FLOP/s value"),
]

TABLE = [(PTDPStrategy, kwargs, match) for kwargs, match in STRATEGY] + RECIPES + CALLBACKS


@pytest.mark.parametrize(("target", "kwargs", "match"), TABLE, ids=[f"{t.__name__}-{sorted(k)}" for t, k, _ in TABLE])
def test_bad_input_is_refused_with_the_rule(target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        target(**kwargs)


def test_the_table_covers_every_strategy_argument():
    """A new PTDPStrategy argument without a bad-input row fails here."""
    arguments = set(inspect.signature(PTDPStrategy).parameters) - LIGHTNING_PLUMBING
    covered = {name for kwargs, _ in STRATEGY for name in kwargs}
    assert arguments - covered == set()


def test_the_table_covers_every_model_and_optimizer_field():
    for config in (GPTConfig, OptimConfig):
        fields = set(inspect.signature(config).parameters)
        covered = {name for target, kwargs, _ in RECIPES if target is config for name in kwargs}
        assert fields - covered == set(), config.__name__


def test_trainer_refuses_a_layout_that_does_not_fit_before_launching():
    import lightning as L

    with pytest.raises(
        ValueError, match=r"tensor_parallel_size\(2\) \* pipeline_parallel_size\(2\) = 4 does not divide"
    ):
        L.Trainer(accelerator="cpu", devices=2, strategy=PTDPStrategy(tensor_parallel_size=2, pipeline_parallel_size=2))
