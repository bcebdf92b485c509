from __future__ import annotations

import hashlib

import pytest

from services.deploy.desired import DesiredDevice
from services.deploy.observe import (
    DeviceReport,
    ObservedContainer,
    ProbeError,
    parse_report,
    probe_script,
)
from services.deploy.reconcile import plan_down, plan_up, status_rows
from tests.deploy.fixtures import desired, inventory, key_set


def converged(want: DesiredDevice, state: str = "running") -> DeviceReport:
    """What a device reports after a deploy of `want` went through."""
    return DeviceReport(
        images={c.image: c.image_id for c in want.containers},
        containers={
            c.name: ObservedContainer(
                "f" * 64, c.name, state, "Up 1 minute (healthy)", c.service, c.config, "1.2.3"
            )
            for c in want.containers
        },
        files={p: f.digest for p, f in want.files.items()},
    )


def kinds(actions):
    return [(a.kind, a.target) for a in actions]


@pytest.fixture
def wants(tmp_path):
    return desired(inventory(), key_set(tmp_path))


def test_an_empty_device_gets_everything_in_order(wants):
    w1 = wants[1]
    actions = plan_up(w1, DeviceReport())
    ks = [a.kind for a in actions]
    assert ks[0] == "ship-image" and ks.count("ship-image") == 1  # worker and profiler share it
    assert ks.count("write-file") == len(w1.files)
    assert ks[-2:] == ["run-container", "run-container"]
    assert ks.index("run-container") > max(i for i, k in enumerate(ks) if k == "write-file")
    assert [a.target for a in actions if a.kind == "run-container"] == [
        "asteroid-lab-w1-worker",
        "asteroid-lab-w1-profiler",
    ]


def test_a_converged_device_needs_nothing(wants):
    for w in wants:
        assert plan_up(w, converged(w)) == []


def test_an_image_present_under_its_id_is_not_shipped(wants):
    w1 = wants[1]
    have = converged(w1)
    have.images.clear()
    have.images["some/other:tag"] = w1.containers[0].image_id
    assert plan_up(w1, have) == []


def test_only_what_differs_is_touched(wants):
    w1 = wants[1]
    have = converged(w1)
    have.files["env/worker.env"] = "0" * 64
    have.files["stale.txt"] = "1" * 64
    worker = have.containers["asteroid-lab-w1-worker"]
    have.containers[worker.name] = ObservedContainer(**{**worker.__dict__, "config": "old"})
    prof = have.containers["asteroid-lab-w1-profiler"]
    have.containers[prof.name] = ObservedContainer(**{**prof.__dict__, "state": "exited"})
    have.containers["asteroid-lab-w1-gone"] = ObservedContainer(
        "e" * 64, "asteroid-lab-w1-gone", "running", "Up", "gone", "x", "1"
    )
    assert kinds(plan_up(w1, have)) == [
        ("write-file", "env/worker.env"),
        ("remove-file", "stale.txt"),
        ("remove-container", "asteroid-lab-w1-gone"),
        ("remove-container", "asteroid-lab-w1-worker"),
        ("run-container", "asteroid-lab-w1-worker"),
        ("start-container", "asteroid-lab-w1-profiler"),
    ]


def test_down_removes_ours_and_only_the_images_we_shipped(wants):
    ctl = wants[0]
    have = converged(ctl)
    redis_ref = ctl.containers[0].image
    control_ref = ctl.containers[1].image
    have.shipped[redis_ref] = ctl.containers[0].image_id
    have.shipped[control_ref] = "sha256:" + "9" * 64  # replaced since: not the image we shipped
    have.volumes.add("asteroid-lab-ctl-redis-data")
    assert kinds(plan_down(ctl, have)) == [
        ("remove-container", "asteroid-lab-ctl-coordinator"),
        ("remove-container", "asteroid-lab-ctl-planner"),
        ("remove-container", "asteroid-lab-ctl-redis"),
        ("remove-volume", "asteroid-lab-ctl-redis-data"),
        ("remove-image", redis_ref),
        ("remove-dir", "/srv/ae/lab/ctl"),
    ]
    assert plan_down(ctl, DeviceReport()) == []


def test_status_rows(wants):
    w2 = wants[2]
    have = converged(w2)
    del have.containers["asteroid-lab-w2-profiler"]
    rows = status_rows(w2, have)
    assert [(r.service, r.state, r.health, r.version, r.current) for r in rows] == [
        ("worker", "running", "healthy", "1.2.3", True),
        ("profiler", "missing", "-", "-", False),
    ]


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


GOOD = "\n".join(
    [
        "@@images",
        f"sha256:{'a' * 64} asteroid-edge/worker:1.2.3",
        f"sha256:{'b' * 64} asteroid-edge/worker:<none>",
        "@@containers",
        "\t".join(
            [
                "c" * 64,
                "asteroid-lab-w1-worker",
                "running",
                "Up 2 minutes (health: starting)",
                "worker",
                "0123456789abcdef",
                "1.2.3",
            ]
        ),
        "@@volumes",
        "asteroid-lab-w1-x",
        "@@files",
        f"{sha('x')}  ./env/worker.env",
        "@@shipped",
        f"sha256:{'a' * 64} asteroid-edge/worker:1.2.3",
        "@@end",
    ]
)


def test_parse_a_report():
    r = parse_report("w1", GOOD)
    assert r.images == {"asteroid-edge/worker:1.2.3": f"sha256:{'a' * 64}"}
    c = r.containers["asteroid-lab-w1-worker"]
    assert (c.state, c.health, c.config, c.version) == (
        "running",
        "starting",
        "0123456789abcdef",
        "1.2.3",
    )
    assert r.files == {"env/worker.env": sha("x")}
    assert r.shipped == {"asteroid-edge/worker:1.2.3": f"sha256:{'a' * 64}"}
    assert r.volumes == {"asteroid-lab-w1-x"}


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        (GOOD.replace("@@end", ""), "ended early"),
        (GOOD.replace("./env/worker.env", "./env/a b"), "unexpected files line"),
        (GOOD.replace("@@volumes", "@@bogus"), "unknown probe section"),
        (GOOD.replace("running", "running\tinjected"), "unexpected containers line"),
        ("x" * (5 << 20), "over"),
        ("\n" * 30_000 + "@@end", "lines"),
    ],
)
def test_a_malformed_report_is_refused_naming_the_device(text, expect):
    with pytest.raises(ProbeError, match=expect) as err:
        parse_report("w1", text)
    assert "device w1" in str(err.value)


def test_a_dotdot_path_is_dropped_not_trusted():
    r = parse_report("w1", GOOD.replace("./env/worker.env", "./env/../x"))
    assert r.files == {}


def test_the_probe_script_quotes_what_it_is_given():
    script = probe_script("lab", "w1", "/srv/ae/lab/w1", ["asteroid-edge/worker"])
    assert "--filter label=asteroid.cluster=lab" in script
    assert "'^asteroid-lab-w1-'" in script
    assert script.splitlines()[-1] == "echo @@end"
