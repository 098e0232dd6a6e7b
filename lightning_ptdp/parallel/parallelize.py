"""The ordered entry point that turns an ordinary model into its PTD-P shard on this rank.

``parallelize`` applies, in a fixed order, each its own function: 0 census, 1 tensor parallel, 1b expert
parallel, 1c context parallel, 1d certificate, 1e fused loss, 2a float8, 2 kernels, 2b compile, 3 recompute, 4 pipeline
split, 4b values (meta materialise or pretrained), 5 data parallel; why this order is in its docstring.
It returns ``Parallelized``: the module to train, the TP report, the pipeline engine, the step's
gradient owner ``StepGradients`` and the ``ShardingView`` checkpoints need.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_ptdp.checkpoint import ShardingView
from lightning_ptdp.config import ParallelConfig
from lightning_ptdp.context_parallel import CPGroup, apply_context_parallel
from lightning_ptdp.core.census import BlockInputs, ModelCensus, ModulesCalled, ParamsReached
from lightning_ptdp.core.dims import ParallelDims
from lightning_ptdp.core.plans import resolve_plan
from lightning_ptdp.data_parallel import apply_data_parallel, apply_fsdp, shard_optimizer_states
from lightning_ptdp.data_parallel.zero1 import ExpertGroups
from lightning_ptdp.expert_parallel import EPGroup, EPReport, ExpertCalls, apply_expert_parallel, routed_parameters
from lightning_ptdp.expert_parallel.placement import SPARE_SLOT
from lightning_ptdp.expert_parallel.rebalance import ExpertBalancer
from lightning_ptdp.kernels import apply_kernels
from lightning_ptdp.parallel.certificate import (
    CertificateReport,
    SummedGradients,
    certify,
    layout_axes,
    whole_blocks_to_certify,
)
from lightning_ptdp.parallel.compile import apply_compile, warn_checkpoint_break
from lightning_ptdp.parallel.float8 import Float8Report, apply_float8
from lightning_ptdp.parallel.fused_loss import FusedLossReport, HeadUses, apply_fused_loss, lm_head_path
from lightning_ptdp.parallel.gradients import DENSE, EXPERTS, ReduceGroup, StepGradients
from lightning_ptdp.parallel.init import is_on_meta, materialize
from lightning_ptdp.parallel.pretrained import Pretrained, load_pretrained
from lightning_ptdp.parallel.recompute import apply_activation_checkpointing
from lightning_ptdp.pipeline import PipelineEngine, apply_pipeline
from lightning_ptdp.tensor_parallel import TPGroup, TPReport, apply_explicit_plan, apply_tensor_parallel
from lightning_ptdp.tensor_parallel.state_dict_hooks import hooked_modules, take_state_dict_hooks

log = logging.getLogger(__name__)


@dataclass
class Parallelized:
    """What ``parallelize`` returns: the module to train, what each step recorded, and the two
    things the strategy delegates to: the step's gradients and what checkpoints need to know."""

    module: torch.nn.Module
    """What the Trainer runs: the model itself, or its DDP wrapper."""
    root: torch.nn.Module
    """The model itself (the LightningModule), never a wrapper."""
    tp_group: Optional[TPGroup] = None
    tp_report: Optional[TPReport] = None
    ep_report: Optional[EPReport] = None
    certificate: Optional[CertificateReport] = None
    float8_report: Optional[Float8Report] = None
    fused_loss: Optional[FusedLossReport] = None
    pipeline: Optional[PipelineEngine] = None
    fsdp: bool = False
    """ZeRO 2/3: FSDP2 shards the gradients (and parameters)."""
    fsdp_mesh: Optional[DeviceMesh] = None
    """What FSDP2 shards over: the replicas (1-D) or, under HSDP, (dp_replicate, dp_shard)."""
    optimizer_state_group: Any = None
    """ZeRO-1 with d > 1: the dp group each optimizer's state is sharded over."""
    optimizer_experts: Optional[ExpertGroups] = None
    """ZeRO-1 with expert parallelism: the split experts, sharded over their own d/e ranks."""
    gradients: StepGradients = field(init=False)
    balancer: Optional[ExpertBalancer] = None
    """``expert_balance``: places the experts anew every interval steps, sums replicas' gradients."""

    def stepped(self, optimizer: Any) -> None:
        """After each optimizer step (the strategy's ``optimizer_step``)."""
        if self.balancer is not None:
            self.balancer.stepped([optimizer])

    def shard_optimizer_states(self, optimizers: list[Any], scheduler_configs: list[Any]) -> list[Any]:
        """ZeRO-1: the optimizers configure_optimizers built, each stepping only its dp rank's share."""
        if self.optimizer_state_group is None:
            return optimizers
        names = {id(p): n for n, p in self.root.named_parameters()}
        return shard_optimizer_states(
            optimizers, scheduler_configs, self.optimizer_state_group, names, self.optimizer_experts
        )

    @property
    def sharding(self) -> ShardingView:
        pipeline = self.pipeline
        return ShardingView(
            module=self.root,
            tensor_parallel=self.tp_report is not None,
            fsdp=self.fsdp,
            pp_group=pipeline.pp_group if pipeline is not None else None,
            aliases=pipeline.split.aliases if pipeline is not None else None,
        )


def parallelize(
    module: torch.nn.Module,
    *,
    config: ParallelConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    probe: Callable[[], Any],
    tp_plan: Optional[dict[str, str]] = None,
    ep_plan: Optional[dict[str, str]] = None,
    training: bool = True,
    pipeline_probe: Optional[Callable[[], tuple[Callable[[], Any], int]]] = None,
    device: torch.device = torch.device("cpu"),
    pretrained: Optional[Pretrained] = None,
    on_nonfinite: str = "raise",
    expert_mesh: Optional[DeviceMesh] = None,
) -> Parallelized:
    """Apply the steps in this fixed order:

    0. census           one run of the user's step on the whole model, every reader's recorder
                        armed (core/census.py): the steps below read it instead of probing.
    1. tensor parallel  rewrite Linear/Embedding weights into per-rank shards before the
                        pipeline split drops the other stages' parameters.
    1b. expert parallel split each MoE layer's experts over the ep ranks (``expert_mesh``), as the
                        census saw the step call them (every rank held them all).
    1c. context parallel cut each block's sequence for the cp ranks; attention gathers keys and
                        values (after TP: this rank's heads; before compile and recompute: they wrap it).
    1d. certificate     the first block of each group under 1-1c against a whole copy taken
                        before step 1, on the probe's inputs (certify_plan): before kernels, compile
                        and recompute wrap the blocks, so it checks the rewrites alone.
    1e. fused loss      the LM head (whole, or TP's vocabulary split) returns its logits uncomputed,
                        for F.cross_entropy to take in chunks (parallel/fused_loss.py): after TP and
                        CP, whose head and tail it computes with; before the split keeps the head.
    2a. float8          (float8=...) the blocks' Linears, whole or TP shards, run torchao's float8
                        matmuls (parallel/float8.py): after TP, which rebuilds Linears as shards.
    2. kernels          route attention and Linear->GeLU to Triton after TP, so each rank's kernel
                        sees its own heads and bias shard.
    2b. compile         (compile=...) wrap each block's forward in torch.compile, over TP and kernels;
                        lazy (it compiles at the first step, after the probes, which record real
                        calls and run eagerly even where the user compiled). Before recompute, so
                        a checkpoint wraps the compiled forward (the replay's state changes inside
                        a checkpoint are what dynamo cannot put in one graph).
    3. recompute        wrap whole blocks after TP, so a recomputed forward replays TP collectives.
    4. pipeline split   keep this rank's p*v chunks of the (sharded) model; its gates wrap the
                        recomputed blocks, so a block of another chunk is never recomputed.
    4b. values          a model built on meta gets storage and values for what this rank kept only:
                        read from pretrained files, or the single-process initialisation.
    5. data parallel    last: it wraps the final per-rank parameters (ZeRO 2/3 shards them over dp;
                        under PP the step's gradient owner averages them over dp chunk by chunk;
                        ZeRO-1 keeps this and shards the optimizer state, see data_parallel/zero1.py).

    ``probe`` runs one ordinary step (the census); ``pipeline_probe`` gives a forward on one microbatch and its sample
    count. Data parallelism only when training. TP, recompute, the split and the pretrained read are
    cached in the model's ``__dict__`` (``_ptdp_tp``...), so a second stage (fit, then validate) reuses them."""
    log.info(
        "parallelize: (pp=%d, dp=%d, cp=%d, tp=%d), zero_stage=%d",
        dims.pp,
        dims.dp,
        dims.cp,
        dims.tp,
        config.zero_stage,
    )
    result = Parallelized(module, root=module, fsdp=config.fsdp)
    check_reusable(module, config, dims)
    if training and config.fsdp:  # FSDP2 shards every module: their state_dict hooks run on whole tensors only
        take_state_dict_hooks(module, hooked_modules(module))
    with torch.compiler.set_stance(
        "force_eager"
    ):  # steps 1-4b record real calls: a block the user compiled runs eagerly
        fuses = config.fused_loss is not False and "_ptdp_fused_loss" not in module.__dict__
        head = lm_head_path(module) if fuses else None
        census, inputs, experts, reached, called = take_census(
            module, config, dims, mesh, probe, ep_plan, training, head
        )
        wholes = whole_blocks_to_certify(module, config, dims, inputs)
        if dims.tp > 1:
            # a second stage (fit, then validate) finds the model already rewritten: reuse that
            if "_ptdp_tp" not in module.__dict__:
                module.__dict__["_ptdp_tp"] = apply_tensor_parallelism(module, config, mesh, inputs, tp_plan)
            result.tp_group, result.tp_report = module.__dict__["_ptdp_tp"]
        if dims.ep > 1:
            if "_ptdp_ep" not in module.__dict__:
                ep_mesh = expert_mesh["ep"]
                group = EPGroup(ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank())
                balance = config.expert_balance
                slots = (balance.experts_per_rank or SPARE_SLOT) if balance else None
                module.__dict__["_ptdp_ep"] = apply_expert_parallel(
                    module, group, experts, ep_plan, config.expert_capacity_factor, slots
                )
            result.ep_report = module.__dict__["_ptdp_ep"]
        if dims.cp > 1 and "_ptdp_cp" not in module.__dict__:
            cp_mesh = mesh["cp"]
            cp = CPGroup(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank())
            sp = dims.tp if config.sequence_parallel else 1
            # under TP the vocabulary-parallel head splits the logits: the sequence leaves the blocks whole
            module.__dict__["_ptdp_cp"] = apply_context_parallel(
                module, cp, sequence_parallel=sp, cut_tail=dims.tp == 1
            )
        if wholes:  # step 1d: each rewritten block against its whole copy, before anything wraps it
            cp_group = (mesh["cp"].get_group(), dims.cp) if dims.cp > 1 else None
            summed = None
            if dims.tp > 1 and dims.cp == dims.ep == 1 and not config.sequence_parallel:  # t alone, no SP
                partial = frozenset(id(getattr(m, n)) for m, n in result.tp_report.partial_grad_params)
                summed = SummedGradients(result.tp_group.group, partial)
            result.certificate = certify(wholes, layout_axes(config, dims), cp_group, summed)
            log.info("plan certificate: %s", result.certificate.summary())
        del wholes, inputs, census
        # the whole copies and probe inputs may sit in reference cycles (a module holding a bound method
        # of itself): collected now, not during the first steps, whose peak they would otherwise raise
        gc.collect()
        if fuses:  # step 1e
            module.__dict__["_ptdp_fused_loss"] = apply_fused_loss(module, head)
        result.fused_loss = module.__dict__.get("_ptdp_fused_loss")
        if config.float8 is not None:  # step 2a; a second stage finds the layers converted
            if "_ptdp_float8" not in module.__dict__:
                module.__dict__["_ptdp_float8"] = apply_float8(
                    module, config.float8, zero_stage=config.zero_stage, device=device
                )
            result.float8_report = module.__dict__["_ptdp_float8"]
        # compiled blocks get inductor's fused kernels: "auto" does not route to Triton under compile;
        # under context parallelism attention is the gathering one (context_parallel/attention.py)
        kernels = "torch" if config.compile is not None else config.kernels
        report = apply_kernels(module, kernels, attention=dims.cp == 1)
        log.info("kernels: %s", report.summary())
        if config.compile is not None:  # hooks around the forward (FSDP's, the pipeline gates) stay eager
            log.info("compiling %d blocks (%s)", len(apply_compile(module, config.compile)), config.compile.backend)
        warn_checkpoint_break(module, config.activation_checkpointing, dims.tp)
        if config.activation_checkpointing is not None and "_ptdp_recompute" not in module.__dict__:
            wrapped = apply_activation_checkpointing(module, config.activation_checkpointing)
            module.__dict__["_ptdp_recompute"] = wrapped
            log.info("activation checkpointing (%s) on %d blocks", config.activation_checkpointing, len(wrapped))
        if dims.pp > 1:
            if "_ptdp_pipeline" not in module.__dict__:
                if pipeline_probe is None:
                    raise ValueError("pipeline_parallel_size > 1 needs pipeline_probe (a forward on one microbatch)")
                run, rows = pipeline_probe()
                module.__dict__["_ptdp_pipeline"] = apply_pipeline(
                    module,
                    pp=dims.pp,
                    vpp=config.virtual_pipeline_size,
                    rank=mesh["pp"].get_local_rank(),
                    schedule=config.pipeline_schedule,
                    micro_batch_size=config.micro_batch_size,
                    pp_group=mesh["pp"].get_group(),
                    device=device,
                    probe=run,
                    probe_rows=rows,
                )
            result.pipeline = module.__dict__["_ptdp_pipeline"]
            result.pipeline.check_reusable(config, dims)
        aliases = result.pipeline.split.aliases if result.pipeline is not None else None
        if pretrained is not None and "_ptdp_pretrained" not in module.__dict__:
            # step 4b: this rank's pieces of the pretrained weights, read from the files
            module.__dict__["_ptdp_pretrained"] = load_pretrained(
                module, pretrained.path, prefix=pretrained.prefix, aliases=aliases, device=device
            )
        elif is_on_meta(module) and device.type != "meta":  # a dry run (planner/meta_run.py) stays on meta
            # built on the meta device (configure_model): allocate and initialise only what TP and the
            # pipeline split left this rank, before data parallelism wraps or shards it
            materialize_shards(module, device, result.pipeline)
    replicas = dims.replica_mesh(mesh)  # dp, or dp x cp: the ranks holding the same parameters
    if training and config.fsdp:  # ZeRO-1 shards only the optimizer state (strategy: data_parallel/zero1.py)
        check_zero_supported(module, config, dims)
        experts = result.ep_report.expert_modules if result.ep_report else []
        edp = expert_mesh["edp"] if experts else None
        result.fsdp_mesh = dims.fsdp_mesh(mesh)  # the replicas, or HSDP's (dp_replicate, dp_shard) view of them
        result.module = apply_fsdp(
            module, result.fsdp_mesh, config.zero_stage, dims.pp > 1, experts, edp, called and called.called
        )
    elif training and dims.pp == 1 and device.type != "meta":  # torch's DDP cannot wrap meta parameters
        experts = result.ep_report.expert_params if result.ep_report else ()
        result.module = apply_data_parallel(module, replicas, ignore=experts, probe=reached or probe)
    if training and config.expert_balance is not None and result.ep_report is not None:
        interval = config.expert_balance.interval
        result.balancer = ExpertBalancer(module, result.ep_report, interval, pipeline=dims.pp > 1)
    if training and config.zero_stage == 1 and replicas.size() > 1:
        result.optimizer_state_group = replicas.get_group()
        if result.ep_report is not None:
            names = set(result.ep_report.expert_params)
            split = {id(p) for n, p in module.named_parameters() if n in names}
            together = result.balancer.owned_together() if result.balancer is not None else {}
            edp = expert_mesh["edp"].get_group()
            result.optimizer_experts = ExpertGroups(frozenset(split), edp, dims.ep, together)
    result.gradients = step_gradients(module, result, config, dims, mesh, expert_mesh, on_nonfinite, device)
    result.gradients.replicas = result.balancer
    return result


def take_census(
    module: torch.nn.Module,
    config: ParallelConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    probe: Callable[[], Any],
    ep_plan: Optional[dict[str, str]],
    training: bool,
    head: Optional[str] = None,
) -> tuple[ModelCensus, BlockInputs, Optional[ExpertCalls], Optional[ParamsReached], Optional[ModulesCalled]]:
    """Step 0: one run of the user's step on the whole model with every reader's recorder armed
    (core/census.py): the blocks' inputs (TP's recording, the certificate), the experts' calls (EP),
    the parameters the step's graph reaches (DDP) and the modules it calls (ZeRO 2-3's units). A
    reader left out is one this layout skips or an earlier stage already served; the blocks' inputs
    are then captured only if asked for.
    ``fused_loss=True`` adds what the step did with the LM head's logits (``head``), refused if not a loss."""
    census = ModelCensus(probe)
    rewritten = any(key in module.__dict__ for key in ("_ptdp_tp", "_ptdp_ep", "_ptdp_cp"))
    records_tp = dims.tp > 1 and "_ptdp_tp" not in module.__dict__
    certifies = config.certify_plan and max(dims.tp, dims.cp, dims.ep) > 1 and not rewritten
    inputs = BlockInputs.of_block_lists(module, probe) if records_tp or certifies else BlockInputs(probe)
    census.add(inputs)
    experts = None
    if dims.ep > 1 and "_ptdp_ep" not in module.__dict__:
        experts = census.add(ExpertCalls(module, resolve_plan(module, ep_plan, "ep_plan") if ep_plan else None))
    reached = None
    if training and not config.fsdp and dims.pp == 1 and dims.replica_mesh(mesh).size() > 1:
        reached = census.add(ParamsReached(module, routed_parameters(module)))
    called = census.add(ModulesCalled()) if training and config.fsdp and dims.pp == 1 else None
    checks_head = config.fused_loss is True and "_ptdp_fused_loss" not in module.__dict__
    uses = census.add(HeadUses(module, head)) if checks_head else None
    census.run()
    if uses is not None:
        uses.check()
    return census, inputs, experts, reached, called


def step_gradients(
    module: torch.nn.Module,
    result: Parallelized,
    config: ParallelConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    expert_mesh: Optional[DeviceMesh],
    on_nonfinite: str,
    device: torch.device,
) -> StepGradients:
    """The owner of each step's gradients. Each placement's reduce group is one entry: the dense
    parameters average over dp, through DDP or FSDP where those wrap the model (without a pipeline,
    or under ZeRO 2/3), else through the owner itself, chunk by chunk during the pipeline's backward.
    Split experts average over the d / e ranks holding the same experts, always through the owner.
    Under context parallelism the dense parameters average over dp x cp."""
    dp = dims.replica_mesh(mesh)
    fsdp = result.fsdp_mesh
    shard = fsdp["dp_shard"] if fsdp is not None and fsdp.ndim == 2 else None  # HSDP: FSDP shards over part of dp
    dense = ReduceGroup(
        group=dp.get_group(),
        size=dp.size(),
        rank=dp.get_local_rank(),
        wrapped=config.fsdp or dims.pp == 1,
        shard=None if shard is None else (shard.get_group(), shard.get_local_rank(), shard.size()),
    )
    groups, placements = {DENSE: dense}, {}
    if result.ep_report is not None:
        edp = expert_mesh["edp"]
        groups[EXPERTS] = ReduceGroup(
            group=edp.get_group(),
            size=edp.size(),
            rank=edp.get_local_rank(),
            divisor=dims.dp * dims.cp,  # each cp rank's share is c times its tokens' (context_parallel/layout.py)
            wrapped=config.fsdp,
        )
        placements = {name: EXPERTS for name in result.ep_report.expert_params}
    pipeline = result.pipeline
    return StepGradients(
        module,
        groups=groups,
        placements=placements,
        tp=result.tp_group,
        partial=result.tp_report.partial_grad_params if result.tp_report else [],
        split=pipeline.split if pipeline is not None else None,
        pp_group=pipeline.pp_group if pipeline is not None else None,
        fsdp=config.fsdp,
        overlap=config.overlap_grad_reduce,
        on_nonfinite=on_nonfinite,
        device=device,
        expert_group=expert_mesh["ep"].get_group() if result.ep_report is not None else None,
    )


def check_reusable(module: torch.nn.Module, config: ParallelConfig, dims: ParallelDims) -> None:
    """A model an earlier Trainer in this process cut (tensor parallelism rewrote its layers into
    this rank's shards, a pipeline dropped its other stages) serves a later Trainer only with the
    same cut: refused otherwise, before anything is changed or run."""
    cached = module.__dict__.get("_ptdp_tp")
    if cached is not None and cached[0].size != dims.tp:
        size = cached[0].size
        raise ValueError(
            f"this model was already rewritten for tensor_parallel_size={size} by an earlier Trainer in this process "
            f"(its layers hold this rank's 1/{size} of their weights), so a Trainer with tensor_parallel_size={dims.tp} "
            f"cannot use it. Keep tensor_parallel_size={size}, or build the model again for the new layout (to carry "
            "the trained weights over, save a checkpoint and load it there: checkpoints load on any layout)"
        )
    pipeline = module.__dict__.get("_ptdp_pipeline")
    if pipeline is not None:
        pipeline.check_reusable(config, dims)


def check_zero_supported(module: torch.nn.Module, config: ParallelConfig, dims: ParallelDims) -> None:
    """Refused at setup, before any step: ZeRO 2/3 cannot shard KV heads copied over several TP ranks
    (t > n_kv_heads), whose copies' gradients must be summed over the tp group before the step."""
    from lightning_ptdp.tensor_parallel.consolidate import split_parameters

    for name, _, _, layout in split_parameters(module):
        if layout.replication == 1:
            continue
        heads = min(layout.parts)
        fits = [t for t in range(1, heads + 1) if all(units % t == 0 for units in layout.parts)]
        raise ValueError(
            f"zero_stage={config.zero_stage} with tensor_parallel_size={dims.tp} > the {heads} key/value heads of "
            f"'{name}': each KV head is replicated over {layout.replication} TP ranks, and ZeRO cannot sum "
            f"those copies' sharded gradients. Use zero_stage=0 or 1, or tensor_parallel_size in {fits} (dividing the "
            "KV heads)"
        )


def materialize_shards(module: torch.nn.Module, device: torch.device, pipeline: Optional[PipelineEngine]) -> None:
    """Step 4b: this rank's parameters get storage and their single-process values. The seeds
    come from rank 0, so ranks that were never seeded alike still build one consistent model."""
    owners = [m for _, m in module.named_modules() if callable(getattr(m, "init_rule", None))]
    seeds = [getattr(m, "init_seed", 0) for m in owners]
    if dist.is_initialized():
        box = [seeds]
        dist.broadcast_object_list(box, src=0)
        seeds = box[0]
    for owner, seed in zip(owners, seeds):
        owner.init_seed = seed
    count = materialize(module, device, pipeline.split.aliases if pipeline is not None else None)
    log.info("materialised %d parameter elements on %s from the meta device", count, device)


def apply_tensor_parallelism(
    module: torch.nn.Module,
    config: ParallelConfig,
    mesh: DeviceMesh,
    inputs: BlockInputs,
    tp_plan: Optional[dict[str, str]],
) -> tuple[TPGroup, TPReport]:
    """Step 1: rewrite the model for its tp group, automatically or from an explicit plan."""
    tp_mesh = mesh["tp"]
    tp = TPGroup(tp_mesh.get_group(), tp_mesh.size(), tp_mesh.get_local_rank())
    if tp_plan is not None:  # checked with the layout at strategy construction (explicit_plan.check_plan)
        report = apply_explicit_plan(module, tp_plan, tp)
    else:
        report = apply_tensor_parallel(
            module, tp, sequence_parallel=config.sequence_parallel, probe=inputs, strict=config.strict_plan
        )
    if dist.get_rank() == 0:
        log.info(report.summary())
    return tp, report
