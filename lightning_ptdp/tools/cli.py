"""The ``ptdp`` command: Lightning's CLI with the PTD-P strategy, plus tool subcommands, e.g.
``ptdp fit --config run.yaml --model=my_pkg.MyModel --trainer.strategy.tensor_parallel_size=2``.

``--model`` and ``--data`` name the user's classes (the console script, ``recipes.cli``, defaults
them to the reference GPT on the Markov corpus: the library itself knows no model);
``--trainer.strategy`` defaults to ``ptdp``. Other subcommands (plan, doctor, checkpoint) are each a
``main(argv) -> int`` named in ``TOOL_COMMANDS``, dispatched before jsonargparse is imported."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Optional, Sequence, Union

STRATEGY_CLASS_PATH = "lightning_ptdp.PTDPStrategy"

TOOL_COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("lightning_ptdp.planner", "main"),
    "doctor": ("lightning_ptdp.tools.doctor", "main"),
    "checkpoint": ("lightning_ptdp.checkpoint.command", "main"),
}
"""Subcommand -> (module, function): ``function(argv) -> exit code``, run without LightningCLI."""


def run_tool(name: str, argv: list[str]) -> int:
    """Run one of ``TOOL_COMMANDS``; say clearly when this installation does not have it yet."""
    module_name, function_name = TOOL_COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        print(f"ptdp {name}: not available in this version ({module_name} is not installed)", file=sys.stderr)
        return 2
    entry = getattr(module, function_name, None)
    if entry is None:
        print(f"ptdp {name}: {module_name} has no {function_name}(argv) entry point", file=sys.stderr)
        return 2
    return int(entry(argv) or 0)


def expand_strategy_name(args: Sequence[str]) -> list[str]:
    """Spell the strategy the way jsonargparse and Lightning each need it.

    ``--trainer.strategy=ptdp`` followed by ``--trainer.strategy.<argument>=...``: jsonargparse
    accepts init arguments only after a class, so the name becomes the class path. Alone, a
    class path would stay a plain string that Lightning's registry does not know, so it becomes
    the registry name ``ptdp``.
    """
    names = ("ptdp", "PTDPStrategy", STRATEGY_CLASS_PATH)
    has_init_args = any(arg.startswith("--trainer.strategy.") for arg in args)
    wanted = STRATEGY_CLASS_PATH if has_init_args else "ptdp"
    out = list(args)
    for i, arg in enumerate(out):
        if arg in (f"--trainer.strategy={name}" for name in names):
            out[i] = f"--trainer.strategy={wanted}"
        elif arg in names and i > 0 and out[i - 1] == "--trainer.strategy":
            out[i] = wanted
    return out


def build_cli(
    args: Optional[Sequence[str]] = None,
    *,
    run: bool = True,
    defaults: Optional[dict[str, str]] = None,
    **cli_kwargs: Any,
):
    """Construct the LightningCLI (and run the subcommand when ``run``); returns the CLI object.
    ``defaults``: class paths for ``model`` and ``data`` when the command line names none."""
    from lightning.pytorch.cli import LightningCLI

    import lightning_ptdp  # noqa: F401  (registers strategy="ptdp")

    class PTDPCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            if defaults:
                parser.set_defaults({key: {"class_path": path} for key, path in defaults.items()})
            parser.add_argument(
                "--dry-run",
                type=Union[bool, float],
                default=False,
                help="dry-run the layout first (true: against the device's memory, or a number of GiB); stop if a rank would not fit",
            )

        def before_fit(self) -> None:
            memory = self.config[self.subcommand].get("dry_run")
            if memory:
                from lightning_ptdp.planner.fit import check_fits_before_fit

                check_fits_before_fit(self.trainer, self.model, self.datamodule, memory)

    if args is None:  # the command line: rewritten in place, so launched ranks re-run the same one
        sys.argv[1:] = expand_strategy_name(sys.argv[1:])
    else:
        args = expand_strategy_name(args)
    return PTDPCLI(
        model_class=None,
        datamodule_class=None,
        args=args,
        run=run,
        trainer_defaults={"strategy": {"class_path": STRATEGY_CLASS_PATH}},
        save_config_kwargs={"overwrite": True},
        **cli_kwargs,
    )


def main(argv: Optional[Sequence[str]] = None, *, defaults: Optional[dict[str, str]] = None) -> None:
    """The ``ptdp`` command (``defaults`` as in ``build_cli``)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in TOOL_COMMANDS:
        raise SystemExit(run_tool(args[0], args[1:]))
    if not args or args[0] in ("-h", "--help"):
        print(f"ptdp subcommands: fit, validate, test, predict (LightningCLI); {', '.join(TOOL_COMMANDS)}\n")
    build_cli(argv, defaults=defaults)


if __name__ == "__main__":
    main()
