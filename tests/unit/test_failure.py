"""The failure records and the messages a stopping rank gets, on an in-process store (no process
group): who failed and with what, who did not report, and a store that died with its host; SIGTERM
from the launcher while the strategy runs."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_ptdp.faults import records as failure
from lightning_ptdp.faults.records import FailureRecords

BROKEN = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4498"


def records(store, rank: int, world_size: int = 2, run: int = 0) -> FailureRecords:
    return FailureRecords(store, run, rank, world_size, timedelta(seconds=1))


def test_a_broken_collective_names_the_rank_that_failed_and_its_error():
    store = dist.HashStore()
    records(store, 1).on_exception(from_cause(ValueError("bad shape")))
    survivor_error = RuntimeError(BROKEN)
    records(store, 0).on_exception(survivor_error)
    assert str(survivor_error) == (
        "rank 1 failed with ValueError: bad shape "
        f"(rank 0 stopped because its collective broke: RuntimeError: {BROKEN})"
    )


def test_the_first_error_of_a_run_is_kept():
    store = dist.HashStore()
    records(store, 2, world_size=4).on_exception(ValueError("first"))
    records(store, 3, world_size=4).on_exception(KeyError("second"))
    survivor_error = RuntimeError("Connection reset by peer")
    records(store, 0, world_size=4).on_exception(survivor_error)
    assert str(survivor_error).startswith("rank 2 failed with ValueError: first (rank 0 stopped")


def test_an_own_error_keeps_its_message():
    error = ValueError("bad shape")
    records(dist.HashStore(), 0).on_exception(error)
    assert str(error) == "bad shape"


def test_without_a_record_the_ranks_that_did_not_report_are_named():
    store = dist.HashStore()
    records(store, 2, world_size=4).on_exception(RuntimeError(BROKEN))  # another survivor
    survivor_error = RuntimeError(BROKEN)
    records(store, 0, world_size=4).on_exception(survivor_error)
    assert str(survivor_error) == (
        "no rank recorded an error, so a rank was killed or ran out of memory (SIGKILL, the OOM killer); "
        "global ranks that had not reported when rank 0 stopped: [1, 3]; their exit codes and logs say which "
        f"(rank 0 stopped because its collective broke: RuntimeError: {BROKEN})"
    )


def test_a_long_list_of_silent_ranks_is_cut_with_the_count():
    survivor_error = RuntimeError(BROKEN)
    records(dist.HashStore(), 0, world_size=64).on_exception(survivor_error)
    assert "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, ... (63 in all)]" in str(survivor_error)


class DeadStore:
    """A store whose host process is gone: every operation fails after the timeout."""

    timeout = timedelta(minutes=5)

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def __getattr__(self, name: str):
        def fail(*args, **kwargs):
            raise dist.DistStoreError("Failed to connect: Connection refused")

        return fail


@pytest.mark.parametrize(
    ("agent_store", "where"),
    [
        (
            None,
            "global rank 0's process (Lightning's launcher), so rank 0 failed or was killed; its own output has the error",
        ),
        ("True", "torchrun's agent, so the launcher itself stopped"),
    ],
)
def test_a_store_that_died_with_its_host_is_named(monkeypatch, agent_store, where):
    if agent_store is None:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", agent_store)
    survivor_error = RuntimeError(BROKEN)
    records(DeadStore(), 1).on_exception(survivor_error)
    assert str(survivor_error) == (
        f"the job's store is unreachable: it lives in {where} "
        f"(rank 1 stopped because its collective broke: RuntimeError: {BROKEN})"
    )


def test_an_own_error_the_store_cannot_take_is_only_warned_about(caplog):
    error = ValueError("bad shape")
    with caplog.at_level(logging.WARNING, logger="lightning_ptdp.faults.records"):
        records(DeadStore(), 1).on_exception(error)
    assert str(error) == "bad shape"
    assert "rank 1 could not record its error in the job's store: Failed to connect" in caplog.text


def test_the_store_timeout_is_restored():
    store = dist.HashStore()
    store.set_timeout(timedelta(minutes=5))
    records(store, 0).on_exception(RuntimeError(BROKEN))
    assert store.timeout == timedelta(minutes=5)


def test_a_later_run_in_the_same_processes_does_not_read_an_earlier_ones_record(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(failure, "job_store", lambda: store)
    first_run = [FailureRecords.open(rank, 2) for rank in (1, 0)]
    second_run = [FailureRecords.open(rank, 2) for rank in (0, 1)]
    assert [r.run for r in first_run + second_run] == [0, 0, 1, 1]
    first_run[0].on_exception(ValueError("in the first run"))
    survivor_error = RuntimeError(BROKEN)
    second_run[0].on_exception(survivor_error)
    assert str(survivor_error).startswith("no rank recorded an error")


def from_cause(cause: BaseException) -> BaseException:
    """``error from cause`` as an expression: how torch's pipeline schedule wraps a stage's error."""
    wrapper = RuntimeError("the stage failed")
    wrapper.__cause__ = cause
    return wrapper


@pytest.fixture
def sigterm_restored():
    """Whatever a test does to SIGTERM's handler, the one before it is put back."""
    before = signal.getsignal(signal.SIGTERM)
    yield before
    signal.signal(signal.SIGTERM, before)


def sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler in the main thread, here, before returning


def test_sigterm_while_running_stops_the_rank_through_on_exception_naming_the_failed_rank(sigterm_restored):
    store = dist.HashStore()
    records(store, 1).on_exception(ValueError("bad shape"))  # the failed rank
    survivor = records(store, 0)
    survivor.catch_sigterm()
    with pytest.raises(failure.Terminated) as stopped:
        sigterm_self()
    survivor.on_exception(stopped.value)
    assert str(stopped.value) == (
        "rank 1 failed with ValueError: bad shape (rank 0 stopped because its launcher terminated it: "
        "Terminated: rank 0 received SIGTERM: its launcher is stopping the job)"
    )
    survivor.release_sigterm()
    assert signal.getsignal(signal.SIGTERM) is sigterm_restored


def test_a_killed_rank_is_named_by_a_rank_its_launcher_terminated(sigterm_restored):
    survivor = records(dist.HashStore(), 0)
    survivor.catch_sigterm()
    with pytest.raises(failure.Terminated) as stopped:
        sigterm_self()
    survivor.on_exception(stopped.value)
    assert str(stopped.value).startswith(
        "no rank recorded an error, so a rank was killed or ran out of memory (SIGKILL, the OOM killer); "
        "global ranks that had not reported when rank 0 stopped: [1]"
    )


def test_sigterm_while_stopping_does_not_interrupt_the_message(sigterm_restored):
    """on_exception puts its own handler in front (Lightning's broadcasts) and only notes SIGTERM."""
    store = dist.HashStore()
    records(store, 1).on_exception(ValueError("bad shape"))

    class SigtermOnGet:  # SIGTERM arrives mid-way through the store operations
        timeout, set_timeout = store.timeout, store.set_timeout

        def __getattr__(self, name):
            return getattr(store, name)

        def get(self, key):
            sigterm_self()
            return store.get(key)

    survivor = records(SigtermOnGet(), 0)
    survivor.catch_sigterm()
    signal.signal(signal.SIGTERM, lambda *_: pytest.fail("Lightning's handler ran while the rank was stopping"))
    survivor_error = RuntimeError(BROKEN)
    survivor.on_exception(survivor_error)
    assert survivor.terminated
    assert str(survivor_error).startswith("rank 1 failed with ValueError: bad shape (rank 0 stopped because its coll")
    survivor.release_sigterm()
    assert signal.getsignal(signal.SIGTERM) is sigterm_restored


def test_a_released_handler_still_installed_acts_as_the_one_before_it(sigterm_restored):
    """Lightning's signal connector puts back, after the strategy's teardown, what it found at the
    run's start (this handler): it then hands SIGTERM on, and a later run skips over it."""
    seen = []

    def before_the_runs(signum, frame):
        seen.append(signum)

    signal.signal(signal.SIGTERM, before_the_runs)
    earlier = records(dist.HashStore(), 0)
    earlier.catch_sigterm()
    earlier.release_sigterm()
    signal.signal(signal.SIGTERM, earlier._on_sigterm)  # as Lightning's connector restores it
    sigterm_self()
    assert seen == [signal.SIGTERM]
    later = records(dist.HashStore(), 0, run=1)
    later.catch_sigterm()
    later.release_sigterm()
    sigterm_self()
    assert signal.getsignal(signal.SIGTERM) is before_the_runs and seen == [signal.SIGTERM] * 2


def test_a_released_handler_over_the_default_ends_the_process_by_sigterm():
    """Never swallowed: with the default action before the run, SIGTERM after it still kills."""
    code = (
        "import os, signal; from datetime import timedelta; import torch.distributed as dist\n"
        "from lightning_ptdp.faults.records import FailureRecords\n"
        "r = FailureRecords(dist.HashStore(), 0, 0, 2, timedelta(seconds=1))\n"
        "r.catch_sigterm(); r.release_sigterm(); signal.signal(signal.SIGTERM, r._on_sigterm)\n"
        "os.kill(os.getpid(), signal.SIGTERM); print('survived')\n"
    )
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ended.returncode == -signal.SIGTERM and "survived" not in ended.stdout, ended.stderr
