"""The local cluster finds itself: the state folder's lock and cluster file, and the look-up.

`asteroid up` on this machine is found by every other command (options >
ASTEROID_* > the running local cluster > defaults); a second `up` on the same
folder refuses naming the first; a file a dead `up` left is ignored; a command
with no cluster anywhere says so at once; `status` neither shows a device
silent past the expiry as ready nor an empty cluster without saying where it
looked. The real `asteroid up` subprocesses are in
tests/integration/test_local_stack.py.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from common.errors import ConfigError
from common.exit_codes import ExitCode
from common.local_cluster import (
    LocalCluster,
    StateDirBusy,
    claim_state_dir,
    cluster_file,
    default_state_dir,
    find_local_cluster,
    resolve,
    tcp_listening,
)
from common.records.devices import DeviceRecord, shown_state
from common.store import Store
from services.cli import app, jobs
from services.cli.example_files import example_path

JOB = {
    "job_id": "j",
    "model": {"name": "small_cnn"},
    "global_batch": 16,
    "micro_batch": 8,
    "rounds": 1,
}


def _cluster(folder: Path, **change: object) -> LocalCluster:
    fields: dict[str, object] = {
        "coordinator": "tcp://127.0.0.1:4567",
        "redis_url": "redis://127.0.0.1:6390/0",
        "cluster": "local",
        "pid": os.getpid(),
        "state_dir": folder,
        "started_at": time.time(),
    }
    return LocalCluster.model_validate({**fields, **change})


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's default state folder, with no ASTEROID_* variable set."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    for name in [k for k in os.environ if k.startswith("ASTEROID_")]:
        monkeypatch.delenv(name)
    return default_state_dir()


def test_a_claimed_folder_is_found_and_forgotten_when_released(state: Path):
    assert state == Path(os.environ["XDG_STATE_HOME"]) / "asteroid"
    assert find_local_cluster() is None
    with claim_state_dir() as claim:
        assert find_local_cluster() is None  # locked, but nothing published yet
        path = claim.publish(_cluster(state))
        assert path == cluster_file() == state / "cluster.json"
        assert path.stat().st_mode & 0o777 == 0o600
        assert find_local_cluster() == _cluster(state, started_at=find_local_cluster().started_at)
    assert not path.exists()
    assert find_local_cluster() is None


def test_a_second_claim_refuses_naming_the_first(state: Path, tmp_path: Path):
    with claim_state_dir(state) as claim:
        claim.publish(_cluster(state))
        with pytest.raises(StateDirBusy) as caught, claim_state_dir(state):
            pass
        said = str(caught.value)
        assert f"pid {os.getpid()}" in said and "tcp://127.0.0.1:4567" in said, said
        assert isinstance(caught.value, ConfigError)  # exit code 2
        # another folder is independent
        with claim_state_dir(tmp_path / "other") as other:
            other.publish(_cluster(tmp_path / "other", coordinator="tcp://127.0.0.1:4568"))
            assert find_local_cluster(tmp_path / "other").coordinator == "tcp://127.0.0.1:4568"
            assert find_local_cluster(state).coordinator == "tcp://127.0.0.1:4567"


def test_a_file_left_by_a_dead_up_is_ignored_and_replaced(state: Path):
    state.mkdir(parents=True, mode=0o700)
    stale = cluster_file(state)
    stale.write_text(_cluster(state, pid=999999).model_dump_json())
    stale.chmod(0o600)
    (state / "lock").write_text("999999\n")  # nobody holds it
    assert find_local_cluster() is None
    assert resolve().origin["coordinator"] == "default"
    with claim_state_dir(state) as claim:
        assert not stale.exists()  # the dead owner's file went at once
        # a live lock, yet a file from before it: not the holder's, ignored
        stale.write_text(_cluster(state, pid=999999).model_dump_json())
        assert find_local_cluster() is None
        claim.publish(_cluster(state))
        assert find_local_cluster().pid == os.getpid()


@pytest.mark.parametrize(
    ("content", "mode", "says"),
    [
        ('{"coordinator": "tcp://x:1"}', 0o600, "not a cluster file"),
        ("x" * (17 << 10), 0o600, "larger than"),
        ("{}", 0o666, "not a private file"),
        (None, 0o600, "coordinator: "),
    ],
)
def test_a_bad_file_of_a_live_cluster_is_named(state: Path, content, mode, says):
    with claim_state_dir(state):
        path = cluster_file(state)
        if content is None:  # a coordinator that is no ZeroMQ address
            content = _cluster(state).model_dump_json().replace("tcp://127.0.0.1:4567", "evil")
        path.write_text(content)
        path.chmod(mode)
        with pytest.raises(ConfigError, match=says):
            find_local_cluster()
        res = CliRunner().invoke(app, ["status"])
        assert res.exit_code == ExitCode.CONFIG, res.output
        assert str(path) in res.output, res.output


def test_options_then_variables_then_the_local_cluster_then_defaults(
    state: Path, monkeypatch: pytest.MonkeyPatch
):
    assert resolve().settings.cluster == "default"
    with claim_state_dir(state) as claim:
        claim.publish(_cluster(state))
        res = resolve()
        assert res.local is not None
        s = res.settings
        assert (s.coordinator, s.redis_url, s.cluster) == (
            "tcp://127.0.0.1:4567",
            "redis://127.0.0.1:6390/0",
            "local",
        )
        assert set(res.origin.values()) == {"local cluster"}
        assert "the cluster `asteroid up` runs on this machine" in res.where()
        # another prefix in the same cluster's Redis
        res = resolve(cluster="other")
        assert (res.settings.cluster, res.origin["cluster"]) == ("other", "option")
        assert res.settings.redis_url == "redis://127.0.0.1:6390/0"
        monkeypatch.setenv("ASTEROID_CLUSTER", "from-env")
        assert resolve().settings.cluster == "from-env"
        assert resolve(cluster="opt").settings.cluster == "opt"
        # a coordinator or Redis named elsewhere is another cluster: nothing mixed in
        res = resolve(coordinator="tcp://10.0.0.9:5555")
        assert res.local is None and res.settings.redis_url == "redis://127.0.0.1:6379/0"
        monkeypatch.setenv("ASTEROID_REDIS_URL", "redis://10.0.0.9:6379/0")
        assert resolve().settings.coordinator == "tcp://127.0.0.1:5555"
        # the same Redis as the local one: the rest is filled in
        monkeypatch.setenv("ASTEROID_REDIS_URL", "redis://127.0.0.1:6390/0")
        assert resolve().settings.coordinator == "tcp://127.0.0.1:4567"


def test_shown_state_does_not_trust_an_old_heartbeat():
    now = 1000.0
    ready = DeviceRecord(device="d", seen=now - 1, state="ready")
    assert shown_state(ready, now, 3.0, 30.0) == "ready"
    assert shown_state(ready.model_copy(update={"seen": now - 10}), now, 3.0, 30.0) == "silent"
    assert shown_state(ready.model_copy(update={"seen": now - 96}), now, 3.0, 30.0) == "stale"
    assert shown_state(ready.model_copy(update={"seen": None}), now, 3.0, 30.0) == "stale"


def test_status_shows_a_device_silent_past_the_expiry_as_stale(
    store: Store, redis_url: str, cluster_name: str, state: Path, monkeypatch
):
    now = time.time()
    for name, age in (("fresh-dev", 0.0), ("old-dev", 96.0)):
        fields = {"device": name, "state": "ready", "seen": now - age, "version": "0.1.0"}
        store.set_fields(fields, "device", name, ttl_s=60)
    monkeypatch.setattr(jobs.console, "width", 200)  # every column in full
    res = CliRunner().invoke(app, ["status", "--redis-url", redis_url, "--cluster", cluster_name])
    assert res.exit_code == 0, res.output
    rows = {line.split()[1]: line for line in res.output.splitlines() if "-dev" in line}
    assert "ready" in rows["fresh-dev"], res.output
    assert "ready" not in rows["old-dev"] and "stale" in rows["old-dev"], res.output
    assert "96." in rows["old-dev"]  # the age shown


def test_status_of_an_empty_cluster_says_where_it_looked(
    redis_url: str, cluster_name: str, state: Path, monkeypatch
):
    monkeypatch.setattr(jobs.console, "width", 200)
    res = CliRunner().invoke(app, ["status", "--redis-url", redis_url, "--cluster", cluster_name])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert f"no devices and no jobs in cluster '{cluster_name}'" in out, out
    assert "asteroid up" in out and "--redis-url" in out and "--cluster" in out, out


def test_train_with_no_cluster_anywhere_says_so_at_once(state: Path, tmp_path: Path):
    defaults = resolve().settings
    if tcp_listening(defaults.coordinator):
        pytest.skip(f"something listens at the default coordinator {defaults.coordinator}")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(JOB))
    for args in (["train", str(job)], ["cancel", "j"], ["drain", "dev-0"]):
        res = CliRunner().invoke(app, args)
        out = " ".join(res.output.split())
        assert res.exit_code == int(ExitCode.UNREACHABLE), (args, out)
        assert "no cluster found: start one with `asteroid up`" in out, (args, out)
        assert "ASTEROID_COORDINATOR" in out and out.count("error:") == 1, out


def test_a_job_file_error_comes_before_no_cluster(state: Path, tmp_path: Path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**JOB, "micro_batch": 5}))
    res = CliRunner().invoke(app, ["train", str(job)])
    assert res.exit_code == ExitCode.CONFIG, res.output
    assert "micro_batch" in res.output and "no cluster found" not in res.output


def test_the_cluster_file_names_no_password_in_its_repr(tmp_path: Path):
    found = _cluster(tmp_path, redis_url="redis://op:s3cret@127.0.0.1:6390/0")
    assert "s3cret" not in repr(found)
    assert json.loads(found.model_dump_json())["redis_url"].endswith("s3cret@127.0.0.1:6390/0")


def test_up_homes_runs_the_federation_holding_the_state_folder(
    state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import services.cli.homes

    calls = []

    def fake(
        homes: int,
        workers: int,
        threads: int,
        logs: Path,
        state_dir: Path | None,
        publish: Callable[[Any], object],
    ) -> None:
        with pytest.raises(StateDirBusy), claim_state_dir(state):  # held while the homes run
            pass
        home0 = SimpleNamespace(
            coordinator="tcp://127.0.0.1:40001", redis_url="redis://127.0.0.1:40002/0",
            cluster="home-0",
        )  # fmt: skip
        publish(home0)
        found = find_local_cluster(state)
        assert found is not None and found.cluster == "home-0"  # status finds home 0
        calls.append((homes, workers, threads, logs, state_dir))

    monkeypatch.setattr(services.cli.homes, "up_homes", fake)
    logs = tmp_path / "logs"
    args = ["up", "--homes", "3", "--workers", "2", "--logs", str(logs)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert calls == [(3, 2, 1, logs, state / "redis")]
    res = CliRunner().invoke(app, [*args, "--job", str(tmp_path / "job.yaml")])
    assert res.exit_code == ExitCode.CONFIG and "--homes" in res.output, res.output


def test_serve_and_infer_ask_the_local_cluster(state: Path, tmp_path: Path):
    """Not the default port 5555: the coordinator the local cluster's file names."""
    spec = tmp_path / "serve.yaml"
    with example_path("serve-gpt2.yaml") as shipped:
        spec.write_text(shipped.read_text())
    with claim_state_dir() as claim:
        claim.publish(_cluster(state, coordinator="tcp://127.0.0.1:4569"))
        for args in (
            ["serve", str(spec), "--reply-timeout", "0.2"],
            ["infer", "gpt2", "--ids", "1,2", "--timeout", "0.2"],
        ):
            res = CliRunner().invoke(app, args)
            out = " ".join(res.output.split())
            assert res.exit_code == int(ExitCode.UNREACHABLE), (args, out)
            assert "tcp://127.0.0.1:4569" in out, (args, out)
