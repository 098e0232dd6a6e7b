"""float8 training (parallelize's step 2a): the transformer blocks' Linears run torchao's float8 matmuls.

Whole nn.Linear layers are swapped by torchao's own ``convert_to_float8_training``. ptdp's tensor-parallel
shards are not nn.Linear, so each gets a ``Float8Matmul`` calling the autograd Function torchao's
Float8Linear calls: every rank scales its own shard (a finer scale than one process's whole tensor).
Under ZeRO-3 with the tensorwise recipe the whole Linears' weights are all-gathered in float8 (torchao's
FSDP2 extension, its scale all-reduced over the shard group). Kept in high precision: the head, the
embeddings, routers, experts, layers outside the blocks, ``skip`` and dimensions not multiples of 16.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from lightning_ptdp.config import Float8Config
from lightning_ptdp.core.blocks import find_block_lists
from lightning_ptdp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

log = logging.getLogger(__name__)

FLOAT8_MARK = "_ptdp_float8"
"""Set on every converted layer: kernel routing (Linear -> GeLU) leaves its matmul to torchao."""
FLOAT8_MULTIPLE = 16
"""torch._scaled_mm needs both dimensions of the weight in multiples of 16 (torchao's own filter rule)."""


class Float8Matmul:
    """y = x @ weight.T (+ bias) with torchao's float8 matmul, for a layer that is not an nn.Linear."""

    def __init__(self, config) -> None:
        from torchao.float8.float8_linear import Float8Linear

        self.config = config
        # torchao's own constructor builds the per-GEMM settings; a meta layer costs no memory
        self.mm_config = Float8Linear(
            FLOAT8_MULTIPLE, FLOAT8_MULTIPLE, bias=False, device="meta", config=config
        ).linear_mm_config

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        if torch.is_autocast_enabled(x.device.type):  # what Float8Linear.forward does for F.linear's autocast
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)
        return y if bias is None else y + bias.to(y.dtype)


@dataclass
class Float8Report:
    recipe: str
    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    """High-precision Linears of the blocks: name -> why."""
    float8_all_gather: bool = False

    def summary(self) -> str:
        kept = "; ".join(f"{name} ({why})" for name, why in list(self.kept.items())[:4])
        more = f" and {len(self.kept) - 4} more" if len(self.kept) > 4 else ""
        gather = ", weights all-gathered in float8" if self.float8_all_gather else ""
        return f"float8 ({self.recipe}{gather}): {len(self.converted)} Linears converted" + (
            f"; kept in high precision: {kept}{more}" if self.kept else ""
        )


def check_float8_device(config: Float8Config, device: torch.device) -> None:
    """float8 matmuls need sm89+ (Ada, Hopper); elsewhere only torchao's emulation runs."""
    if config.emulate:
        return
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability < (8, 9):
        where = f"{device}" if capability is None else f"{device} (compute capability {capability[0]}.{capability[1]})"
        raise ValueError(
            f"float8={config.recipe!r} runs float8 matmuls, which need a CUDA GPU of compute capability 8.9 or "
            f"later (Ada, Hopper), but the model runs on {where}; pass float8={{'recipe': {config.recipe!r}, "
            "'emulate': True}} to emulate the float8 rounding with high-precision matmuls (numerics, no speed-up), "
            "or float8=False"
        )


def torchao_config(config: Float8Config, *, zero_stage: int):
    from torchao.float8 import Float8LinearConfig

    recipe = Float8LinearConfig.from_recipe_name(config.recipe)
    power_of_2 = config.power_of_2_scales or recipe.round_scales_to_power_of_2
    # FSDP2's float8 all-gather exists for one scale per tensor only (torchao refuses it for rowwise), and
    # its scale is never rounded to a power of 2 (torchao 0.18's fsdp_pre_all_gather): off where asked for
    gather = zero_stage == 3 and config.recipe == "tensorwise" and not power_of_2
    return dataclasses.replace(
        recipe, emulate=config.emulate, enable_fsdp_float8_all_gather=gather, round_scales_to_power_of_2=power_of_2
    )


def _moe_layers(model: nn.Module) -> tuple[set[int], set[int]]:
    """(routers, experts): Linears choosing among a sibling set of experts (one output per expert), and
    the Linears of a ModuleList's experts. Routing stays precise; an expert's few rows make small
    GEMMs, which float8 speeds up only grouped (a grouped float8 GEMM ptdp does not route to yet)."""
    from lightning_ptdp.expert_parallel.discovery import expert_list_candidates, router_linears, stacked_experts

    routers: set[int] = set()
    experts: set[int] = set()
    for site in expert_list_candidates(model):
        routers |= {id(r) for r in router_linears(site.module, site.num_experts)}
        experts |= {id(m) for m in getattr(site.module, site.experts_attr).modules()}
    for layer in model.modules():
        for child in layer.children():
            n = stacked_experts(child)
            if n:
                routers |= {id(r) for r in router_linears(layer, n)}
    return routers, experts


def _reason_kept(name: str, layer: nn.Module, config: Float8Config, moe: tuple[set[int], set[int]]) -> Optional[str]:
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in config.skip):
        return "float8 skip"
    if id(layer) in moe[0]:
        return "router"
    if id(layer) in moe[1]:
        return "expert (no grouped float8 GEMM)"
    shape = tuple(layer.weight.shape)
    if any(size % FLOAT8_MULTIPLE for size in shape):
        return f"weight {list(shape)} not in multiples of {FLOAT8_MULTIPLE}"
    return None


def apply_float8(model: nn.Module, config: Float8Config, *, zero_stage: int, device: torch.device) -> Float8Report:
    """Convert the blocks' Linears (after TP: whole ones and this rank's shards) to float8 training."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    check_float8_device(config, device)
    ao_config = torchao_config(config, zero_stage=zero_stage)
    report = Float8Report(config.recipe, float8_all_gather=ao_config.enable_fsdp_float8_all_gather)
    moe = _moe_layers(model)
    matmul = Float8Matmul(ao_config)  # no state of its own: one for every shard layer
    whole: set[int] = set()
    for prefix, blocks in find_block_lists(model):
        for index, block in enumerate(blocks):
            for local, layer in block.named_modules():
                name = f"{prefix}.{index}.{local}" if local else f"{prefix}.{index}"
                sharded = isinstance(layer, (ColumnParallelLinear, RowParallelLinear))
                if not (sharded or type(layer) is nn.Linear or isinstance(layer, Float8Linear)):
                    continue
                why = _reason_kept(name, layer, config, moe)
                if why is not None:
                    report.kept[name] = why
                    continue
                report.converted.append(name)
                if sharded:
                    layer.float8 = matmul
                elif type(layer) is nn.Linear:
                    whole.add(id(layer))
    # torchao's entry point also installs its inductor fix for float8 kernels: called even with no whole Linear
    convert_to_float8_training(model, module_filter_fn=lambda m, _: id(m) in whole, config=ao_config)
    for name in report.converted:
        setattr(model.get_submodule(name), FLOAT8_MARK, True)
    log.info(report.summary())
    return report
