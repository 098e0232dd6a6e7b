"""Typed, validated configuration for PTD-P training.

Every field is checked at construction, so a bad value fails in the launching process, before
any worker starts or any collective can hang. Messages state the value, the rule and the fix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import Literal, Optional, Union, get_args

# Every choice list, once: the strategy's signature uses the Literal types, validation the tuples.
PipelineSchedule = Literal["interleaved_1f1b", "1f1b", "gpipe", "zero_bubble"]
KernelMode = Literal["auto", "triton", "torch"]
RecomputeMode = Literal["full", "selective"]
NonfinitePolicy = Literal["raise", "skip", "ignore"]
CheckpointFormat = Literal["sharded", "full"]
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
Float8Recipe = Literal["tensorwise", "rowwise"]

PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
KERNEL_MODES: tuple[str, ...] = get_args(KernelMode)
RECOMPUTE_MODES: tuple[str, ...] = get_args(RecomputeMode)
NONFINITE_POLICIES: tuple[str, ...] = get_args(NonfinitePolicy)
CHECKPOINT_FORMATS: tuple[str, ...] = get_args(CheckpointFormat)
START_METHODS: tuple[str, ...] = get_args(StartMethod)
FLOAT8_RECIPES: tuple[str, ...] = get_args(Float8Recipe)
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
PROCESS_GROUP_BACKENDS: tuple[str, ...] = ("gloo", "nccl", "mpi", "ucc", "xccl")

COMPILE_MODES: tuple[Optional[str], ...] = (None, "default", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES: tuple[str, ...] = ("reduce-overhead", "max-autotune")

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Collective timeout: long enough for a slow first NCCL connect, short enough that a dead rank
turns into an error on the others within minutes instead of torch's 30."""
FAILURE_TIMEOUT = timedelta(seconds=10)
"""How long a stopping rank waits on the job's store: it answers in milliseconds while it is up;
when it died with rank 0, connecting retries until this runs out, and then the rank says so."""


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1 (bools excluded), else raise a ValueError that says so."""
    if isinstance(value, bool) or not isinstance(value, int):
        hint = f"; did you mean {name}={int(value)}?" if isinstance(value, float) and value.is_integer() else ""
        raise ValueError(f"{name}={value!r} must be a positive integer, got {type(value).__name__}{hint}")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1; use 1 to switch this kind of parallelism off")
    return value


def _check_choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}={value!r} is not one of {options}; choose one of those")


def _switch_of(cls: type, name: str, value: object, keys_hint: str) -> tuple[bool, object]:
    """An option given as False/None (off), True (defaults), a dict of ``cls``'s fields or a ``cls``:
    (True, the config or None), or (False, None) for any other value (the caller says what it takes)."""
    if value is None or value is False:
        return True, None
    if value is True:
        return True, cls()
    if isinstance(value, cls):
        return True, value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{name}={value!r}: unknown keys {unknown}; {keys_hint}")
        return True, cls(**value)
    return False, None


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """``torch.compile`` of every transformer block's forward after ptdp's rewrites (regional
    compilation, as torchtitan does); the fields are torch.compile's own arguments."""

    backend: str = "inductor"
    mode: Optional[str] = None
    fullgraph: bool = False
    """True: a block dynamo cannot trace as one graph is an error naming the block, not a graph break."""
    dynamic: Optional[bool] = None

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(
                f"compile backend={self.backend!r} must be the name of a torch.compile backend, e.g. 'inductor'"
            )
        if self.mode in CUDA_GRAPH_MODES:
            raise ValueError(
                f"compile mode={self.mode!r} records CUDA graphs, which replay fixed input buffers and a fixed "
                "sequence of collectives, while ptdp hands each block new tensors every microbatch (pipeline, "
                "gradient buckets); use mode='max-autotune-no-cudagraphs' or mode=None"
            )
        _check_choice("compile mode", self.mode, COMPILE_MODES)
        import torch._dynamo  # only when compiling: the backends this torch knows

        known = torch._dynamo.list_backends(exclude_tags=())
        if self.backend not in known:
            raise ValueError(
                f"compile backend={self.backend!r} is not a torch.compile backend on this machine; choose one of "
                f"{', '.join(repr(b) for b in known)} ('inductor' generates fused kernels, 'aot_eager' only traces)"
            )
        if not isinstance(self.fullgraph, bool):
            raise ValueError(f"compile fullgraph={self.fullgraph!r} must be True or False")
        if self.dynamic not in (None, True, False):
            raise ValueError(f"compile dynamic={self.dynamic!r} must be None, True or False")

    @classmethod
    def of(cls, value: object) -> Optional["CompileConfig"]:
        """``compile=`` as the strategy takes it: False/None (off), True (defaults), a dict or a CompileConfig."""
        hint = "ptdp passes backend, mode, fullgraph and dynamic to torch.compile for each block"
        known, config = _switch_of(cls, "compile", value, hint)
        if not known:
            raise ValueError(
                f"compile={value!r} must be True, False, a dict of torch.compile arguments or a CompileConfig"
            )
        return config

    def kwargs(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Float8Config:
    """float8 training of the transformer blocks' Linears through torchao (``torchao.float8``): each
    such Linear, whole or a tensor-parallel shard, runs its three matmuls in float8 with dynamic scales.
    The blocks' Linears only: the head, the embeddings, the routers and anything outside the blocks
    stay in the model's precision, as torchtitan keeps its output layer."""

    recipe: Float8Recipe = "tensorwise"
    """torchao's recipe names: "tensorwise" (one scale per tensor, the fastest; under ZeRO-3 the
    weights are all-gathered in float8) or "rowwise" (a scale per row, more accurate)."""
    skip: tuple[str, ...] = ()
    """fnmatch patterns of module names kept in high precision ("*.attn.*", "layers.0.*")."""
    emulate: bool = False
    """torchao's emulation: float8 rounding with high-precision matmuls, for CPUs and GPUs below sm89
    (numerics tests; no speed-up)."""
    power_of_2_scales: bool = False
    """Round each scale down to a power of 2 (the rowwise recipe always does): a value then rounds the
    same whatever scale its tensor, shard or microbatch got, except near the float8 range's ends."""

    def __post_init__(self) -> None:
        _check_choice("float8 recipe", self.recipe, FLOAT8_RECIPES)
        if isinstance(self.skip, str) or not all(isinstance(p, str) for p in self.skip):
            raise ValueError(f"float8 skip={self.skip!r} must be a list of module-name patterns, e.g. ['*.mlp.*']")
        object.__setattr__(self, "skip", tuple(self.skip))
        for name in ("emulate", "power_of_2_scales"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"float8 {name}={getattr(self, name)!r} must be True or False")
        try:
            import torchao.float8  # noqa: F401  (the extra: only when float8 is asked for)
        except ImportError as err:
            raise ValueError(
                f"float8={self!r} needs torchao ({err}); install it with `pip install torchao` "
                "(or `pip install lightning-ptdp[float8]`), or leave float8 off"
            ) from None

    @classmethod
    def of(cls, value: object) -> Optional["Float8Config"]:
        """``float8=`` as the strategy takes it: False/None (off), True (tensorwise), a recipe name,
        a dict of these fields or a Float8Config."""
        if isinstance(value, str):
            _check_choice("float8", value, FLOAT8_RECIPES)
            return cls(recipe=value)
        known, config = _switch_of(cls, "float8", value, f"the keys are {[f.name for f in fields(cls)]}")
        if known:
            return config
        raise ValueError(
            f"float8={value!r} must be True, False, 'tensorwise', 'rowwise', a dict of Float8Config's fields "
            "or a Float8Config"
        )


@dataclass(frozen=True, kw_only=True)
class ExpertBalanceConfig:
    """Balanced expert placement (expert_parallel/rebalance.py): every ``interval`` optimizer steps
    each MoE layer's experts are placed anew from the rows routed to them since, a hot expert
    replicated on several ranks, its tokens split among them. The result is one process's."""

    interval: int = 100
    """Optimizer steps between placements (weights and optimizer state move then)."""
    experts_per_rank: Optional[int] = None
    """The memory cap: slots a rank holds, at least n/e; None: n/e + 1 (a spare slot a rank)."""

    def __post_init__(self) -> None:
        for name, value in (("interval", self.interval), ("experts_per_rank", self.experts_per_rank)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"expert_balance {name}={value!r} must be an integer >= 1 (interval: optimizer steps between "
                    "placements; experts_per_rank: at least n/e, None for n/e + 1)"
                )

    @classmethod
    def of(cls, value: object) -> Optional["ExpertBalanceConfig"]:
        """``expert_balance=`` as the strategy takes it: False/None (off), True (defaults), an int
        (the interval), a dict of these fields or an ExpertBalanceConfig."""
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(interval=value)
        known, config = _switch_of(cls, "expert_balance", value, f"the keys are {[f.name for f in fields(cls)]}")
        if known:
            return config
        raise ValueError(
            f"expert_balance={value!r} must be True, False, an interval in steps, a dict of ExpertBalanceConfig's "
            "fields (interval, experts_per_rank) or an ExpertBalanceConfig"
        )


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How one model is split across devices: the degrees and the techniques of PTD-P."""

    tensor_parallel_size: int = 1
    """t: ranks that split every layer's weights (Megatron tensor parallelism). Keep within a node."""
    pipeline_parallel_size: int = 1
    """p: pipeline stages; the model's layers are divided among them."""
    expert_parallel_size: int = 1
    """e: ranks that split each mixture-of-experts layer's experts (n_experts / e whole experts each),
    carved out of the d data-parallel ranks as Megatron does; tokens reach their experts all-to-all."""
    context_parallel_size: int = 1
    """c: ranks that split each sequence (2c load-balanced chunks; attention gathers keys and values)."""
    data_parallel_size: Union[int, Literal["auto"]] = "auto"
    """d: model replicas; "auto" takes world_size / (t * p * c)."""
    virtual_pipeline_size: int = 1
    """v: model chunks per pipeline rank for the interleaved schedule (bubble (p-1)/(v*m))."""
    micro_batch_size: Union[int, None] = None
    """b: samples per pipeline microbatch (m = per-replica batch / b microbatches per step); None
    means the whole per-replica batch is one microbatch."""
    sequence_parallel: bool = False
    """Shard norms, dropout and residuals along the sequence inside each TP group (needs t > 1)."""
    strict_plan: bool = False
    """Refuse at setup where tensor-parallel discovery cannot split a region, instead of running that
    region whole on every rank with a ``PartialSplitWarning`` and splitting the rest."""
    certify_plan: bool = True
    """Before the first step, run the first block of each group (alike in structure and code) under
    the layout (t, c, e) and whole on the probe's inputs, and refuse if outputs or input gradients
    differ (parallel/certificate.py)."""
    zero_stage: int = 0
    """0: replicated; 1: optimizer state sharded over d (torch's ZeroRedundancyOptimizer, gradients
    all-reduced whole); 2: and gradients (FSDP2); 3: and parameters (FSDP2)."""
    data_parallel_shard_size: Optional[int] = None
    """ZeRO 2-3 as HSDP: shard within groups of this many consecutive data-parallel ranks (typically a
    node's), replicate across the groups (gradients reduce-scattered in the group, then all-reduced
    across groups). None: shard over all of d (x c)."""
    activation_checkpointing: Union[RecomputeMode, None] = None
    """None, "full" (recompute each transformer block) or "selective" (only the attention core)."""
    pipeline_schedule: PipelineSchedule = "interleaved_1f1b"
    """Pipeline schedule used when p > 1."""
    kernels: KernelMode = "auto"
    """"auto": Triton kernels where they can run; "triton": force them; "torch": never."""
    overlap_grad_reduce: bool = True
    """Under PP with d > 1 (no ZeRO): start each chunk's dp gradient all-reduce as soon as its last
    backward ran, overlapping the other chunks' compute (Megatron-Core's option of that name)."""
    compile: Union[bool, dict, CompileConfig, None] = None
    """torch.compile each transformer block after the rewrites: True, a dict of torch.compile
    arguments or a ``CompileConfig``; stored as a ``CompileConfig`` or None."""
    float8: Union[bool, str, dict, Float8Config, None] = None
    """float8 matmuls in the blocks' Linears (torchao): True, "tensorwise", "rowwise", a dict or a
    ``Float8Config``; stored as a ``Float8Config`` or None."""
    expert_capacity_factor: Optional[float] = None
    """Megatron's and Switch Transformer's expert capacity, opt-in: in training each expert takes at
    most this factor times an even share of a rank's (token, expert) rows, those of the largest routing
    weights; the rest are dropped (their experts add nothing: the token keeps its residual path). It
    changes the result. Needs e > 1 (ptdp's exchange drops them) and per-token top-k routing."""
    expert_balance: Union[bool, int, dict, ExpertBalanceConfig, None] = None
    """Balanced expert placement with hot experts replicated (``ExpertBalanceConfig``): True, an
    interval in steps, a dict or the config; stored as the config or None. Needs e > 1, ZeRO 0-1."""
    fused_loss: Optional[bool] = None
    """The LM head and F.cross_entropy computed together in chunks of tokens, never the whole logits
    (parallel/fused_loss.py): None where the step uses the logits only for that loss (the same
    result), True to require it (refused at setup otherwise), False never."""

    @property
    def fsdp(self) -> bool:
        """ZeRO stages 2 and 3 shard gradients (and parameters) with FSDP2; stage 1 keeps DDP's."""
        return self.zero_stage >= 2

    def __post_init__(self) -> None:
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        check_positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        check_positive_int("expert_parallel_size", self.expert_parallel_size)
        check_positive_int("context_parallel_size", self.context_parallel_size)
        if self.data_parallel_size != "auto":
            check_positive_int("data_parallel_size", self.data_parallel_size)
        check_positive_int("virtual_pipeline_size", self.virtual_pipeline_size)
        if self.micro_batch_size is not None:
            check_positive_int("micro_batch_size", self.micro_batch_size)
        if self.data_parallel_shard_size is not None:
            check_positive_int("data_parallel_shard_size", self.data_parallel_shard_size)
        for name in ("sequence_parallel", "strict_plan", "certify_plan", "overlap_grad_reduce"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        factor = self.expert_capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
            raise ValueError(
                f"expert_capacity_factor={factor!r} must be a number > 0 (1.0: each expert takes an even share of "
                "a rank's routed rows; Switch Transformer used 1.0-2.0), or None for no capacity"
            )
        if factor is not None and self.expert_parallel_size == 1:
            raise ValueError(
                f"expert_capacity_factor={factor} needs expert_parallel_size > 1: ptdp drops the rows past capacity "
                "in its token exchange, and at expert_parallel_size=1 the model's own experts run untouched; set "
                "expert_parallel_size, or leave expert_capacity_factor unset"
            )
        if self.fused_loss is not None and not isinstance(self.fused_loss, bool):
            raise ValueError(f"fused_loss={self.fused_loss!r} must be None (where it applies), True or False")
        _check_choice("zero_stage", self.zero_stage, ZERO_STAGES)
        if self.activation_checkpointing is not None:
            _check_choice("activation_checkpointing", self.activation_checkpointing, (None, *RECOMPUTE_MODES))
        _check_choice("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        _check_choice("kernels", self.kernels, KERNEL_MODES)
        object.__setattr__(self, "compile", CompileConfig.of(self.compile))
        object.__setattr__(self, "float8", Float8Config.of(self.float8))
        object.__setattr__(self, "expert_balance", ExpertBalanceConfig.of(self.expert_balance))
        self._check_combinations()

    def _check_combinations(self) -> None:
        balance = self.expert_balance
        if balance is not None and self.expert_parallel_size == 1:
            raise ValueError(
                f"expert_balance={balance} needs expert_parallel_size > 1: it places (and replicates) experts over "
                "the ranks that split them, and at expert_parallel_size=1 every rank holds every expert; set "
                "expert_parallel_size, or leave expert_balance unset"
            )
        if balance is not None and self.fsdp:
            raise ValueError(
                f"expert_balance with zero_stage={self.zero_stage}: FSDP2 shards each rank's expert slots over its "
                "d / e replicas, so a replica's gradient cannot be summed with its other holders' slot by slot; use "
                "zero_stage 0 or 1 with expert_balance, or leave expert_balance unset"
            )
        if self.compile is not None and self.kernels == "triton":
            raise ValueError(
                "kernels='triton' with compile: ptdp's Triton kernels are routed by a runtime hook that inductor "
                "cannot compile yet, and inductor writes its own fused attention and GeLU kernels; use "
                "kernels='auto' (compiled blocks then use inductor's kernels) or compile=False"
            )
        if self.data_parallel_shard_size is not None and not self.fsdp:
            raise ValueError(
                f"data_parallel_shard_size={self.data_parallel_shard_size} shards parameters, gradients and optimizer "
                f"state within groups of data-parallel ranks (HSDP), which is FSDP2's: it needs zero_stage 2 or 3, "
                f"not {self.zero_stage}; set zero_stage=3 (or 2), or leave data_parallel_shard_size unset"
            )
        if self.data_parallel_shard_size is not None and self.expert_parallel_size > 1:
            raise ValueError(
                f"data_parallel_shard_size={self.data_parallel_shard_size} with expert_parallel_size="
                f"{self.expert_parallel_size} is not supported yet (split experts shard over their own d / e ranks); "
                "leave data_parallel_shard_size unset or use expert_parallel_size=1"
            )
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "sequence_parallel=True needs tensor_parallel_size > 1 (it shards activations inside the "
                "tensor-parallel group); set tensor_parallel_size=2 or more, or sequence_parallel=False"
            )
        if self.virtual_pipeline_size > 1 and self.pipeline_parallel_size == 1:
            raise ValueError(
                f"virtual_pipeline_size={self.virtual_pipeline_size} needs pipeline_parallel_size > 1 "
                "(it interleaves chunks across pipeline ranks); set pipeline_parallel_size or use 1"
            )
        if self.pipeline_schedule == "zero_bubble" and self.fsdp and self.pipeline_parallel_size > 1:
            raise ValueError(
                f"pipeline_schedule='zero_bubble' with zero_stage={self.zero_stage} is not supported yet (FSDP2 under "
                "the deferred weight-gradient step is untested); use 'interleaved_1f1b' or zero_stage=0 or 1"
            )
        if self.virtual_pipeline_size > 1 and self.pipeline_schedule == "1f1b":
            raise ValueError(
                f"virtual_pipeline_size={self.virtual_pipeline_size} needs a schedule that runs several chunks per "
                "rank, but pipeline_schedule='1f1b' runs one; use 'interleaved_1f1b' (or 'gpipe', 'zero_bubble'), "
                "or virtual_pipeline_size=1"
            )


def check_timeout(timeout: object, name: str = "failure_timeout") -> timedelta:
    if not isinstance(timeout, timedelta):
        raise ValueError(f"{name}={timeout!r} must be a datetime.timedelta (e.g. timedelta(seconds=10))")
    if timeout.total_seconds() <= 0:
        raise ValueError(
            f"{name}={timeout} must be positive; it bounds how long a stopping rank waits on the job's store"
        )
    return timeout


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How the run behaves around the parallel model: failures, checkpoints, process groups."""

    on_nonfinite: str = "raise"
    """A non-finite loss or gradient on any rank: "raise" everywhere, "skip" the step everywhere, "ignore"."""
    checkpoint_format: str = "sharded"
    """"sharded": each rank writes its pieces (a folder); "full": rank 0 writes one unsharded file."""
    process_group_backend: Optional[str] = None
    """None: gloo on CPU, nccl on GPU."""
    timeout: Optional[timedelta] = DEFAULT_TIMEOUT
    failure_timeout: timedelta = FAILURE_TIMEOUT
    start_method: str = "popen"

    def __post_init__(self) -> None:
        _check_choice("on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"checkpoint_format={self.checkpoint_format!r} is not one of 'sharded' (each rank writes its pieces, "
                "a folder) or 'full' (rank 0 writes one file of unsharded tensors); choose one of those"
            )
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method={self.start_method!r} must be 'popen', 'spawn', 'fork' or 'forkserver'")
        if self.process_group_backend not in (None, *PROCESS_GROUP_BACKENDS):
            raise ValueError(
                f"process_group_backend={self.process_group_backend!r} is not one of "
                f"{', '.join(repr(b) for b in PROCESS_GROUP_BACKENDS)}; or None for gloo on CPU, nccl on GPU"
            )
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise ValueError(
                f"timeout={self.timeout!r} must be a datetime.timedelta (e.g. timedelta(minutes=10)) or None"
            )
        if self.timeout is not None and self.timeout.total_seconds() <= 0:
            raise ValueError(f"timeout={self.timeout} must be positive; a dead rank turns into an error after it")
        check_timeout(self.failure_timeout)
