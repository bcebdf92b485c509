from __future__ import annotations

import hashlib
import re

import pytest

from common.errors import ConfigError
from services.deploy.credentials import acl_file, redis_passwords
from services.deploy.desired import RUNTIME_UID
from tests.deploy.fixtures import ACL, VERSION, desired, image_ids, inventory, key_set, known


def test_roles_give_their_containers_with_names_labels_and_limits(tmp_path):
    inv = inventory()
    want = desired(inv, key_set(tmp_path))
    assert [w.device.name for w in want] == ["ctl", "w1", "w2"]  # control first
    names = {w.device.name: [c.name for c in w.containers] for w in want}
    assert names["ctl"] == [f"asteroid-lab-ctl-{s}" for s in ("redis", "coordinator", "planner")]
    assert names["w2"] == ["asteroid-lab-w2-worker", "asteroid-lab-w2-profiler"]
    worker = want[2].containers[0]
    argv = worker.run_argv()
    for flag in (["--restart", "unless-stopped"], ["--network", "host"], ["--cpus", "0.5"]):
        i = argv.index(flag[0])
        assert argv[i : i + 2] == flag
    assert argv[argv.index("--memory") + 1] == str(512 << 20)
    assert f"asteroid.config={worker.config}" in argv
    assert "asteroid.version=1.2.3" in argv
    assert argv[-2:] == [f"asteroid-edge/worker:{VERSION}", "asteroid-worker"]
    assert "asteroid-probe 127.0.0.1:7000" in argv  # the inventory's data port
    redis = want[0].containers[0]
    assert "--memory" not in redis.run_argv()  # never OOM-kill the cluster's state
    assert redis.run_argv()[-1] != "6379" and "6400" in redis.run_argv()


def test_each_service_holds_only_its_own_secret_and_password(tmp_path):
    want = desired(inventory(), key_set(tmp_path))
    files = {w.device.name: w.files for w in want}
    secrets = {
        (dev, p)
        for dev, fs in files.items()
        for p in fs
        if p.endswith((".key_secret", ".password"))
    }
    assert secrets == {
        ("ctl", "redis/operator.password"),
        ("ctl", "keys/coordinator/coordinator/coordinator.key_secret"),
        ("ctl", "keys/coordinator/redis/coordinator.password"),
        ("ctl", "keys/planner/services/planner.key_secret"),
        ("ctl", "keys/planner/redis/planner.password"),
        ("w1", "keys/worker/workers/w1.key_secret"),
        ("w1", "keys/worker/redis/worker.password"),
        ("w1", "keys/profiler/services/profiler.key_secret"),
        ("w1", "keys/profiler/redis/profiler.password"),
        ("w2", "keys/worker/workers/w2.key_secret"),
        ("w2", "keys/worker/redis/worker.password"),
        ("w2", "keys/profiler/services/profiler.key_secret"),
        ("w2", "keys/profiler/redis/profiler.password"),
    }
    # every public key of the set, so peers and the coordinator can be checked
    assert "keys/worker/workers/w2.key" in files["w1"]
    assert "keys/worker/coordinator/coordinator.key" in files["w1"]
    secret = files["w1"]["keys/worker/workers/w1.key_secret"]
    assert (secret.mode, secret.owner) == (0o600, RUNTIME_UID)


def test_settings_hold_no_password_and_the_acl_only_hashes(tmp_path):
    keys = key_set(tmp_path)
    inv = inventory()
    want = desired(inv, keys)
    passwords = redis_passwords(inv, keys)
    env = want[1].files["env/worker.env"].content.decode()
    assert "ASTEROID_REDIS_URL=redis://worker@10.0.0.1:6400/0\n" in env
    assert "ASTEROID_REDIS_PASSWORD_FILE=/keys/redis/worker.password\n" in env
    assert "ASTEROID_DEVICE=w1\n" in env
    assert "ASTEROID_COORDINATOR=tcp://10.0.0.1:6000\n" in env
    assert "ASTEROID_THREADS" not in env  # 0: the worker's own default
    for w in want:
        for path, f in w.files.items():
            if path.endswith("users.acl") or path.endswith(".env"):
                for pw in passwords.values():
                    assert pw.encode() not in f.content, path
    acl = want[0].files["redis/users.acl"].content.decode()
    digest = hashlib.sha256(passwords["worker"].encode()).hexdigest()
    assert f"user worker on #{digest} " in acl
    assert "SHA256_OF" not in acl and not re.search(r"^#", acl, re.M)
    assert len(set(passwords.values())) == len(passwords)


def test_passwords_come_from_the_key_set_when_it_has_them(tmp_path):
    keys = key_set(tmp_path)
    inv = inventory()
    keys["redis/worker.password"] = b"s3cret-from-the-set\n"
    assert redis_passwords(inv, keys)["worker"] == "s3cret-from-the-set"
    keys["redis/worker.password"] = b"two words\n"
    with pytest.raises(ConfigError, match=r"worker\.password is malformed"):
        redis_passwords(inv, keys)


def test_the_same_inputs_give_the_same_configs(tmp_path):
    keys = key_set(tmp_path)
    inv = inventory()
    a, b = desired(inv, keys), desired(inv, keys)
    assert [c.config for w in a for c in w.containers] == [
        c.config for w in b for c in w.containers
    ]


def test_a_change_touches_exactly_the_containers_it_concerns(tmp_path):
    keys = key_set(tmp_path)
    inv = inventory()
    before = {c.name: c.config for w in desired(inv, keys) for c in w.containers}
    data = inv.model_dump(mode="json")
    data["devices"][2]["cpus"] = 1.5
    after = {c.name: c.config for w in desired(inventory(**data), keys) for c in w.containers}
    changed = {n for n in before if before[n] != after[n]}
    assert changed == {"asteroid-lab-w2-worker", "asteroid-lab-w2-profiler"}
    data["devices"][2]["cpus"] = 0.5
    data["devices"][2]["threads"] = 1
    after = {c.name: c.config for w in desired(inventory(**data), keys) for c in w.containers}
    assert {n for n in before if before[n] != after[n]} == {"asteroid-lab-w2-worker"}
    # a new image id for the worker image restarts the workers and profilers only
    salted = {c.name: c.config for w in desired(inv, keys, salt="x") for c in w.containers}
    assert {n for n in before if before[n] != salted[n]} == set(before)  # every image changed
    # a rotated worker key restarts that device's worker only
    (tmp_path / "workers" / "w1.key_secret").write_bytes(
        (tmp_path / "workers" / "w1.key_secret").read_bytes() + b"#\n"
    )
    rotated = {c.name: c.config for w in desired(inv, key_set(tmp_path)) for c in w.containers}
    assert {n for n in before if before[n] != rotated[n]} == {"asteroid-lab-w1-worker"}


def test_missing_keys_and_images_are_named(tmp_path):
    keys = key_set(tmp_path, workers=("w1",))
    with pytest.raises(ConfigError, match=r"device w2: the key set has no workers/w2.key_secret"):
        desired(inventory(), keys)
    keys = key_set(tmp_path / "b")
    del keys["coordinator/coordinator.key_secret"]
    with pytest.raises(ConfigError, match="no coordinator secret key"):
        desired(inventory(), keys)
    inv = inventory()
    data = inv.model_dump(mode="json")
    data["devices"][1]["arch"] = "arm64"
    from services.deploy.desired import desired_state

    with pytest.raises(ConfigError, match=r"device w1: no image asteroid-edge/worker:1.2.3-arm64"):
        desired_state(
            known(inventory(**data)),
            key_set(tmp_path / "c"),
            ACL.read_text(),
            image_ids(inv),
            VERSION,
        )


def test_a_registry_prefixes_the_images(tmp_path):
    inv = inventory(registry="registry.lan:5000/edge")
    want = desired(inv, key_set(tmp_path))
    assert want[1].containers[0].image == f"registry.lan:5000/edge/asteroid-edge/worker:{VERSION}"


def test_acl_template_placeholders_are_all_filled():
    text = acl_file(
        ACL.read_text(),
        {
            u: f"pw-{u}"
            for u in ("coordinator", "worker", "planner", "profiler", "operator", "admin")
        },
    )
    assert b"SHA256_OF" not in text
    with pytest.raises(ConfigError, match="names user 'worker'"):
        acl_file(ACL.read_text(), {"coordinator": "x"})
