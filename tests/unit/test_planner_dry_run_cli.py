"""``ptdp plan --model``: the command's flags reach the dry run (the run itself: tests/distributed/test_dry_run.py)."""

from __future__ import annotations


def test_plan_model_passes_its_precision_and_world_to_the_dry_run(monkeypatch, capsys):
    import lightning_ptdp.planner.fit as fit
    from lightning_ptdp.planner.cli import main

    seen = {}

    def dry_run(factory, **kwargs):
        seen.update(factory=factory, **kwargs)
        return []

    monkeypatch.setattr(fit, "dry_run", dry_run)
    monkeypatch.setattr(fit, "format_dry_run", lambda reports, memory, cluster: "table")
    assert main(["--model", "pkg.mod:build", "--gpus", "16", "--precision", "bf16-mixed"]) == 0
    assert seen == {
        "factory": "pkg.mod:build",
        "devices": 8,
        "num_nodes": 2,
        "device_memory_gb": 80.0,
        "precision": "bf16-mixed",
    }
    main(["--model", "pkg.mod:build", "--gpus", "2"])
    assert seen["precision"] == "32-true"  # Lightning's Trainer default
