"""The ``ptdp`` command: argument forms (in process, nothing launched), the Lightning
subcommands end to end, a user's own classes by class path, and a 2-node x 2-process job
under torchrun on localhost."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_ptdp import PTDPStrategy
from lightning_ptdp.tools import cli
from recipes import cli as recipes_cli
from recipes.data import MarkovDataModule
from recipes.gpt import GPTLightningModule

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures]")

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
HERE = "tests.integration.test_cli"
QUICK = [
    "--trainer.accelerator=cpu",
    "--trainer.max_steps=5",
    "--trainer.limit_val_batches=2",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--data.train_tokens=20000",
]


# ---------------------------------------------------------------- classes the subprocesses load by class path
class RunRecorder(L.Callback):
    """Writes what one rank saw to ``<out_dir>/<stage>-rank<N>.json``: its ranks, its mesh
    coordinates, the training losses, the final metrics and the number of predicted batches."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.losses: list[float] = []
        self.predicted_batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.predicted_batches += 1

    def teardown(self, trainer, pl_module, stage: str) -> None:
        strategy = trainer.strategy
        record = {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "strategy": type(strategy).__name__,
            "mesh_coordinate": strategy.device_mesh.get_coordinate() if isinstance(strategy, PTDPStrategy) else None,
            "losses": self.losses,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "predicted_batches": self.predicted_batches,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stage_name = getattr(stage, "value", stage)  # Lightning passes a TrainerFn
        (self.out_dir / f"{stage_name}-rank{trainer.global_rank}.json").write_text(json.dumps(record))


class EvaluatedGPT(GPTLightningModule):
    """A user's module: the reference GPT plus test and predict steps."""

    def test_step(self, batch, batch_idx) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(dim=-1)  # (B, T) next-token guesses


class MarkovWithTestSplit(MarkovDataModule):
    def test_dataloader(self):
        return self.val_dataloader()


# ---------------------------------------------------------------- helpers
def ptdp_command() -> list[str]:
    """The installed console script when there is one (Lightning re-runs it for rank 1), else -m."""
    script = Path(sys.executable).parent / "ptdp"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "recipes.cli"]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    """``cmd`` from a fresh temporary folder: what it writes where it runs (Lightning's
    lightning_logs/ without a default_root_dir) never lands in the source tree."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="ptdp-cli-") as cwd:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def records(out_dir: Path, stage: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob(f"{stage}-rank*.json"))]


def recorder_args(out_dir: Path) -> list[str]:
    return [f"--trainer.callbacks+={HERE}.RunRecorder", f"--trainer.callbacks.out_dir={out_dir}"]


@pytest.fixture
def parse(monkeypatch):
    """Build the CLI in this process without running a subcommand (no process is launched)."""
    monkeypatch.setattr(sys, "argv", ["ptdp"])
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the seed LightningCLI sets stays here
    return lambda *args: recipes_cli.build_cli(["--trainer.accelerator=cpu", *args], run=False)


# ---------------------------------------------------------------- argument forms
@pytest.mark.parametrize(
    "strategy_args",
    [
        [
            "--trainer.strategy=ptdp",
            "--trainer.strategy.tensor_parallel_size=1",
            "--trainer.strategy.data_parallel_size=2",
        ],
        ["--trainer.strategy", "ptdp", "--trainer.strategy.data_parallel_size=2"],
        ["--trainer.strategy=lightning_ptdp.PTDPStrategy", "--trainer.strategy.data_parallel_size=2"],
        ["--trainer.strategy.data_parallel_size=2"],  # ptdp is the default strategy
    ],
)
def test_strategy_by_name_or_class_path_with_its_arguments(parse, strategy_args):
    built = parse(*strategy_args, "--trainer.devices=2")
    assert isinstance(built.trainer.strategy, PTDPStrategy)
    assert built.trainer.strategy.parallel_config.data_parallel_size == 2
    assert built.trainer.strategy.parallel_dims.world_size == 2


@pytest.mark.parametrize("name", ["ptdp", "lightning_ptdp.PTDPStrategy"])
def test_strategy_alone_resolves_through_the_registry(parse, name):
    built = parse(f"--trainer.strategy={name}", "--trainer.devices=1")
    assert isinstance(built.trainer.strategy, PTDPStrategy)


def test_other_lightning_strategies_still_work(parse):
    built = parse("--trainer.strategy=ddp", "--trainer.devices=2")
    assert type(built.trainer.strategy).__name__ == "DDPStrategy"


def test_defaults_are_the_reference_gpt_on_the_markov_corpus(parse):
    built = parse("--trainer.devices=1", "--model.model.num_layers=3", "--data.batch_size=4")
    assert type(built.model) is GPTLightningModule and built.model.model_config.num_layers == 3
    assert type(built.datamodule) is MarkovDataModule and built.datamodule.batch_size == 4


def test_the_library_command_knows_no_model(monkeypatch, capsys):
    """Only the recipes' console script defaults the model: the library never imports recipes/."""
    monkeypatch.setattr(sys, "argv", ["ptdp"])
    with pytest.raises(SystemExit):
        cli.build_cli(["--trainer.accelerator=cpu", "--trainer.devices=1"], run=False)
    assert "required: model" in capsys.readouterr().err


def test_user_classes_by_class_path(parse):
    built = parse("--trainer.devices=1", f"--model={HERE}.EvaluatedGPT", f"--data={HERE}.MarkovWithTestSplit")
    assert type(built.model) is EvaluatedGPT and type(built.datamodule) is MarkovWithTestSplit


def test_invalid_degree_is_refused_with_the_rule(parse):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 must be >= 1"):
        parse("--trainer.strategy.tensor_parallel_size=0", "--trainer.devices=1")


def tool_for_test(argv: list[str]) -> int:
    return 7 if argv == ["--x"] else 1


def test_tool_subcommands_dispatch_before_lightning(monkeypatch, capsys):
    monkeypatch.setitem(cli.TOOL_COMMANDS, "plan", (HERE, "tool_for_test"))
    monkeypatch.setitem(cli.TOOL_COMMANDS, "doctor", ("lightning_ptdp._no_such_tool", "main"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--x"])
    assert exit_info.value.code == 7
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["doctor"])
    assert exit_info.value.code == 2 and "not available in this version" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(cli.TOOL_COMMANDS))
def test_tool_entry_points_exist_once_their_module_has_landed(name):
    module_name, function_name = cli.TOOL_COMMANDS[name]
    module = pytest.importorskip(module_name)
    assert callable(getattr(module, function_name))


# ---------------------------------------------------------------- subcommands end to end
def test_fit_then_validate_from_a_config_file(tmp_path):
    config = tmp_path / "fit.yaml"
    config.write_text(
        f"trainer:\n  default_root_dir: {tmp_path}\nmodel:\n  init_args:\n    model:\n      num_layers: 1\n"
    )
    run(
        [
            *ptdp_command(),
            "fit",
            f"--config={config}",
            *QUICK,
            "--trainer.strategy=ptdp",
            "--trainer.strategy.tensor_parallel_size=1",
            "--trainer.devices=2",
            *recorder_args(tmp_path),
        ]
    )
    fitted = records(tmp_path, "fit")
    assert [r["global_rank"] for r in fitted] == [0, 1]
    assert all(len(r["losses"]) == 5 and r["strategy"] == "PTDPStrategy" for r in fitted)
    assert [r["mesh_coordinate"] for r in fitted] == [[0, 0, 0], [0, 1, 0]]
    (checkpoint,) = tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    assert (tmp_path / "lightning_logs/version_0/config.yaml").is_file()  # LightningCLI saved the config

    run(
        [
            *ptdp_command(),
            "validate",
            f"--config={config}",
            *QUICK,
            "--trainer.devices=1",
            f"--ckpt_path={checkpoint}",
            *recorder_args(tmp_path),
        ]
    )
    (validated,) = records(tmp_path, "validate")
    assert 0.0 < validated["metrics"]["val_loss"] < 6.0


def test_test_and_predict_with_user_classes(tmp_path):
    user_classes = [f"--model={HERE}.EvaluatedGPT", f"--data={HERE}.MarkovWithTestSplit"]
    for subcommand in ("test", "predict"):
        run(
            [
                sys.executable,
                "-m",
                "recipes.cli",
                subcommand,
                *QUICK,
                *user_classes,
                "--trainer.devices=1",
                "--trainer.limit_test_batches=2",
                "--trainer.limit_predict_batches=3",
                *recorder_args(tmp_path),
            ]
        )
    (tested,) = records(tmp_path, "test")
    assert 0.0 < tested["metrics"]["test_loss"] < 6.0
    (predicted,) = records(tmp_path, "predict")
    assert predicted["predicted_batches"] == 3


# ---------------------------------------------------------------- two nodes on localhost
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_two_nodes(out_dir: Path, port: int) -> tuple[list[int], str]:
    """Run ``ptdp fit`` as two torchrun "nodes" of two processes; the exit codes and log tails."""
    out_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    nodes = []
    for node_rank in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=2",
            f"--node_rank={node_rank}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            "-m",
            "recipes.cli",
            "fit",
            *QUICK,
            "--trainer.num_nodes=2",
            "--trainer.devices=2",
            "--trainer.strategy=ptdp",
            "--trainer.strategy.tensor_parallel_size=2",
            f"--trainer.default_root_dir={out_dir / f'node{node_rank}'}",
            *recorder_args(out_dir / "ranks"),
        ]
        log = open(out_dir / f"node{node_rank}.log", "w")
        nodes.append((subprocess.Popen(cmd, cwd=out_dir, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [proc.wait(timeout=TIMEOUT_S) for proc, _ in nodes]
    finally:
        for proc, log in nodes:
            if proc.poll() is None:
                proc.kill()
            log.close()
    return codes, "\n".join((out_dir / f"node{i}.log").read_text()[-3000:] for i in (0, 1))


def test_two_nodes_of_two_processes_under_torchrun(tmp_path):
    """Two torchrun agents, one per "node", meet at a static rendezvous on 127.0.0.1; each starts
    two workers. Lightning's TorchElastic environment gives the ranks; t = 2 inside each node and
    d = 2 across the nodes, the placement the paper uses (TP on NVLink, DP over the network)."""
    for attempt in range(2):  # the free port can be taken between choosing and binding it
        codes, logs = start_two_nodes(tmp_path / f"attempt{attempt}", free_port())
        if codes == [0, 0] or "address already in use" not in logs.lower():
            break
    assert codes == [0, 0], logs

    ranks = records(tmp_path / f"attempt{attempt}" / "ranks", "fit")
    assert [(r["global_rank"], r["node_rank"], r["local_rank"]) for r in ranks] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert all(r["world_size"] == 4 for r in ranks)
    # (pp, dp, tp), tp fastest: the two ranks of one node form a tensor-parallel group
    assert [r["mesh_coordinate"] for r in ranks] == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]
    losses = torch.tensor([r["losses"] for r in ranks])
    assert losses.shape == (4, 5) and torch.isfinite(losses).all()
    # Both TP ranks of a replica read the same samples and compute the same loss.
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close(losses[3], losses[2])
    synced = torch.tensor([r["metrics"]["train_loss"] for r in ranks])
    assert torch.allclose(synced, synced[0])  # logged with sync_dist: the dp mean, same on every rank


def test_fit_dry_run_stops_a_layout_that_would_not_fit_before_any_process_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(sys, "argv", ["ptdp"])
    monkeypatch.setattr(os, "environ", dict(os.environ))
    args = ["fit", "--trainer.accelerator=cpu", "--trainer.devices=1", "--dry-run=1e-6", "--model.model.num_layers=2"]
    with pytest.raises(ValueError, match=r"would hold .* more than the device's 1e-06 GiB.*no layout of 1 devices"):
        recipes_cli.build_cli(args)
    assert not dist.is_initialized()
