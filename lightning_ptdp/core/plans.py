"""Explicit plans by module path: ``{"path or fnmatch glob": style}`` resolved against a model's
modules. Shared by ``tp_plan`` and ``ep_plan``: every key must match a module, and a module matched
by two keys must get one style."""

from __future__ import annotations

import difflib
import fnmatch

import torch.nn as nn

GLOB_CHARS = "*?["


def resolve_plan(model: nn.Module, plan: dict[str, str], argument: str) -> dict[str, str]:
    """{module path: style} for every module the plan's paths and globs match; ``argument`` names
    the plan in errors ("tp_plan")."""
    paths = [path for path, _ in model.named_modules() if path]
    known = set(paths)
    resolved: dict[str, str] = {}
    source: dict[str, str] = {}
    for pattern, style in plan.items():
        glob = any(c in pattern for c in GLOB_CHARS)
        matched = [p for p in paths if fnmatch.fnmatchcase(p, pattern)] if glob else [pattern] * (pattern in known)
        if not matched:
            probe = pattern.replace("*", "0").replace("?", "0")
            close = difflib.get_close_matches(probe, paths, n=5, cutoff=0.6)
            hint = f"; close paths: {', '.join(close)}" if close else f"; paths look like: {', '.join(paths[:5])}"
            raise ValueError(
                f"{argument} key '{pattern}' matches no module of {type(model).__name__}{hint} "
                "(keys are module paths, or globs over them such as 'model.layers.*.mlp.up_proj')"
            )
        for path in matched:
            if resolved.get(path, style) != style:
                raise ValueError(
                    f"{argument}: '{path}' is matched by '{source[path]}' ({resolved[path]!r}) and by '{pattern}' "
                    f"({style!r}); one module takes one style: narrow one of the patterns"
                )
            resolved[path] = style
            source.setdefault(path, pattern)
    return resolved
