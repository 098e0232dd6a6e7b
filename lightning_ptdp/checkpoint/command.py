"""Sharded checkpoint <-> one file, on one machine, with no process group.

    ptdp checkpoint consolidate CKPT OUT.pt                  the model's plain state_dict
    ptdp checkpoint consolidate CKPT OUT.safetensors --strip-prefix net.model.   the inner model's own keys
    ptdp checkpoint consolidate CKPT OUT.ckpt --full         the whole checkpoint, as checkpoint_format="full" writes it
    ptdp checkpoint shard IN.pt CKPT                         a plain state_dict or a full checkpoint, as a sharded one

Made from a full checkpoint it resumes ``fit`` on any layout; from a state_dict it holds weights only.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, Optional, Sequence

import torch

from lightning_ptdp.checkpoint.dcp_load import open_checkpoint
from lightning_ptdp.checkpoint.dcp_save import FORMAT_VERSION, MODEL, save

_OPTIMIZER = "optimizer_states."


def _read(path: str, keep: Any = lambda key: True) -> dict[str, Any]:
    """Every entry of a sharded checkpoint whose key ``keep`` accepts, whole, on this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    reader, metadata = open_checkpoint(os.path.realpath(path))
    targets = {
        key: torch.empty(md.size, dtype=md.properties.dtype) if hasattr(md, "size") else None
        for key, md in metadata.state_dict_metadata.items()
        if keep(key)
    }
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(targets, storage_reader=reader, planner=planner, no_dist=True)
    return planner.state_dict


def consolidated_state_dict(path: str, strip_prefix: str = "") -> dict[str, torch.Tensor]:
    """The single-process model's state_dict from a sharded checkpoint saved on any layout;
    ``strip_prefix`` keeps the entries under one submodule, named as that module names them."""
    entries = _read(path, lambda key: key.startswith(MODEL + strip_prefix))
    return {key[len(MODEL + strip_prefix) :]: value for key, value in entries.items()}


def write_state_dict(state: dict[str, torch.Tensor], output: str) -> None:
    """``.safetensors`` (what transformers' ``from_pretrained`` reads), else torch.save."""
    if output.endswith(".safetensors"):
        from safetensors.torch import save_file

        seen: dict[int, str] = {}  # a tensor stored under two names (a tie) is written once
        unique = {k: v.contiguous() for k, v in state.items() if seen.setdefault(id(v), k) == k}
        save_file(unique, output, metadata={"format": "pt"})
    else:
        torch.save(state, output)


def consolidate(path: str) -> dict[str, Any]:
    """The whole checkpoint in the full format: unsharded weights, optimizer state keyed by
    parameter name, Lightning's loops, callbacks, schedulers and hyperparameters."""
    entries = _read(path, lambda key: not key.startswith("rng."))
    checkpoint = dict(entries.pop("lightning"))
    entries.pop("ptdp", None)
    checkpoint["state_dict"] = {k[len(MODEL) :]: v for k, v in entries.items() if k.startswith(MODEL)}
    optimizers: dict[int, dict[str, Any]] = {}
    for key, value in entries.items():
        if not key.startswith(_OPTIMIZER):
            continue
        index, rest = key[len(_OPTIMIZER) :].split(".", 1)
        optimizer = optimizers.setdefault(int(index), {"state": {}, "param_groups": []})
        if rest.startswith("state."):
            name, field = rest[len("state.") :].rsplit(".", 1)
            optimizer["state"].setdefault(name, {})[field] = value
        else:  # param_groups.<rank>: join the stages' parameter lists group by group
            for number, group in enumerate(value):
                if number == len(optimizer["param_groups"]):
                    optimizer["param_groups"].append({**group, "params": []})
                merged = optimizer["param_groups"][number]["params"]
                merged += [p for p in group["params"] if p not in merged]
    checkpoint["optimizer_states"] = [optimizers[i] for i in sorted(optimizers)]
    return checkpoint


def shard(source: dict[str, Any], target: str) -> None:
    """Write ``source`` (a plain state_dict, or a full checkpoint with "state_dict") as a sharded
    checkpoint at ``target`` that any layout loads."""
    if "state_dict" in source:
        checkpoint = dict(source)
    else:  # weights only; Lightning reads its version from every checkpoint
        from lightning.pytorch import __version__

        checkpoint = {"state_dict": source, "pytorch-lightning_version": __version__}
    flat: dict[str, Any] = {f"{MODEL}{k}": v for k, v in checkpoint.pop("state_dict").items()}
    for index, optimizer in enumerate(checkpoint.pop("optimizer_states", [])):
        names = [name for name in optimizer["state"] if not isinstance(name, str)]
        if names:
            raise ValueError(
                f"optimizer {index}'s state is keyed by parameter index ({names[:3]}...), as torch's "
                "optimizer.state_dict() writes it; ptdp needs parameter names to place it on another layout. Save it "
                "with PTDPStrategy(checkpoint_format='full') or convert the weights alone (pass --weights-only)"
            )
        for name, values in optimizer["state"].items():
            flat.update({f"{_OPTIMIZER}{index}.state.{name}.{k}": v for k, v in values.items()})
        flat[f"{_OPTIMIZER}{index}.param_groups.0"] = optimizer["param_groups"]
    flat["ptdp"] = {"format": FORMAT_VERSION, "world_size": 1, "converted": True}
    flat["lightning"] = checkpoint
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        save(flat, target, no_dist=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="ptdp checkpoint", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="a sharded checkpoint as one file")
    merge.add_argument("checkpoint", help="the sharded checkpoint's folder (or its name)")
    merge.add_argument("output", help="the file to write")
    merge.add_argument("--full", action="store_true", help="the whole checkpoint, not only the model's state_dict")
    merge.add_argument("--strip-prefix", default="", help="keep the weights under this module path, without it")
    split = commands.add_parser("shard", help="a file as a sharded checkpoint")
    split.add_argument("input", help="a plain state_dict or a full checkpoint (torch.save file)")
    split.add_argument("output", help="the checkpoint name to write (a folder link)")
    split.add_argument("--weights-only", action="store_true", help="convert the model's weights alone")
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)  # as save_pretrained does
        if args.full:
            torch.save(consolidate(args.checkpoint), args.output)
        else:
            write_state_dict(consolidated_state_dict(args.checkpoint, args.strip_prefix), args.output)
        return 0
    source = torch.load(args.input, map_location="cpu", weights_only=False)
    if args.weights_only and "state_dict" in source:
        source = source["state_dict"]
    shard(source, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
