"""The test harness reports what its cleanup had to do, and still cleans up."""

from __future__ import annotations

import time

import pytest

from tests import cluster as harness
from tests.cluster import CLEANUP_MARGIN_S, GLOBAL_TIMEOUT_S, Budget, LocalCluster
from tests.pyproject import pyproject

STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('stubborn and alive', flush=True); time.sleep(120)"
)
POLITE = "import time; print('polite', flush=True); time.sleep(120)"


def _child(local: LocalCluster, name: str, code: str, worker: bool = True):
    proc = local.spawn(name, ["-c", code])
    if worker:
        local.workers.append(name)
    return proc


def test_close_reports_a_child_that_ignores_sigterm_and_kills_it(tmp_path):
    local = LocalCluster(tmp_path, "redis://127.0.0.1:1/0", "unused")
    stubborn = _child(local, "w-stubborn", STUBBORN)
    polite = _child(local, "w-polite", POLITE)
    _wait_printed(local, "w-stubborn", "stubborn and alive")
    with pytest.raises(AssertionError, match=r"\['w-stubborn'\] did not stop") as err:
        local.close(grace_s=1)
    assert "stubborn and alive" in str(err.value)  # its log tail
    assert "w-polite" not in str(err.value)
    assert stubborn.poll() is not None and polite.poll() is not None


def test_wait_workers_exit_reports_stragglers_and_bad_exit_codes(tmp_path):
    local = LocalCluster(tmp_path, "redis://127.0.0.1:1/0", "unused")
    straggler = _child(local, "w-late", POLITE)
    _child(local, "w-crash", "import sys; print('crashed here'); sys.exit(3)")
    _child(local, "w-fine", "pass")
    _child(local, "planner", POLITE, worker=False)  # not a worker: not waited for
    with pytest.raises(AssertionError) as err:
        local.wait_workers_exit(timeout_s=3)
    text = str(err.value)
    assert "w-late: still running, killed" in text and "polite" in text
    assert "w-crash: exit code 3" in text and "crashed here" in text
    assert "w-fine" not in text and "planner" not in text
    assert straggler.poll() is not None
    local.close()
    local.wait_workers_exit(timeout_s=1, names=["w-fine"])  # the ones left out pass


def test_waits_are_capped_by_the_test_budget(tmp_path):
    local = LocalCluster(tmp_path, "redis://127.0.0.1:1/0", "unused", budget=Budget(1))
    _child(local, "coordinator", POLITE, worker=False)
    with pytest.raises(AssertionError, match=r"coordinator did not exit within 1 s \(1 s test"):
        local.wait("coordinator", timeout_s=240)
    assert local.procs["coordinator"].poll() is not None


def test_kill_all_reports_children_a_test_left_running(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "_CHILDREN", [])
    local = LocalCluster(tmp_path, "redis://127.0.0.1:1/0", "unused")
    leaked = _child(local, "w-leak", POLITE)
    _wait_printed(local, "w-leak", "polite")
    with pytest.raises(AssertionError, match="w-leak") as err:
        harness.kill_all()
    assert "polite" in str(err.value)
    assert leaked.poll() is not None
    harness.kill_all()  # nothing left: quiet


def _wait_printed(local: LocalCluster, name: str, text: str) -> None:
    """Until the child has printed `text` (so it set up its signal handling)."""
    budget = Budget(30)
    while text not in local.log(name):
        assert budget.left(1) > 0, f"{name} printed nothing in 30 s:\n{local.log(name)}"
        assert local.procs[name].poll() is None, local.log(name)
        time.sleep(0.05)


def test_default_budget_is_the_global_timeout_less_the_cleanup_margin(tmp_path):
    ini = pyproject()["tool"]["pytest"]["ini_options"]
    assert float(ini["timeout"]) == GLOBAL_TIMEOUT_S
    local = LocalCluster(tmp_path, "redis://127.0.0.1:1/0", "unused")
    assert local.budget.total_s == GLOBAL_TIMEOUT_S - CLEANUP_MARGIN_S
