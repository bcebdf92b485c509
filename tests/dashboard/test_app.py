"""The dashboard's routes: the page, its JSON, /metrics, and what they refuse."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
import typer
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient
from typer.testing import CliRunner

from common.entry_points import service_command
from common.exit_codes import ExitCode
from common.records.jobs import index_job, write_job_state
from services.cli.dashboard import dashboard
from services.dashboard.app import create_app
from services.dashboard.state import ClusterReader


@pytest.fixture
def client(store, cluster_name):
    write_job_state(store, "j1", "running")
    index_job(store, "j1")
    app = create_app(ClusterReader(store, cluster_name, 3.0))
    with TestClient(app, base_url="http://127.0.0.1:8050") as c:
        yield c


def test_the_page_is_one_file_that_loads_nothing_from_elsewhere(client):
    res = client.get("/")
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/html")
    page = res.text
    assert "/api/state" in page and "<svg" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page and "innerHTML" not in page
    csp = res.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp


def test_the_state_and_metrics_answer(client, cluster_name):
    state = client.get("/api/state").json()
    assert state["cluster"] == cluster_name and state["job"]["job"] == "j1"
    assert client.get("/api/state", params={"job": "j1"}).json()["job"]["state"] == "running"
    res = client.get("/metrics")
    assert res.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {f.name for f in text_string_to_metric_families(res.text)}
    assert {"asteroid_redis_up", "asteroid_job_state", "asteroid_rounds_committed"} <= names


def test_bad_ids_other_hosts_and_writes_are_refused(client):
    res = client.get("/api/state", params={"job": "*"})
    assert res.status_code == 400 and "pattern" in res.json()["error"]
    assert client.get("/api/state", headers={"host": "attacker.example"}).status_code == 400
    assert client.post("/api/state").status_code == 405
    assert client.delete("/metrics").status_code == 405


def test_beyond_loopback_any_host_is_answered(store, cluster_name):
    app = create_app(ClusterReader(store, cluster_name, 3.0), loopback_only=False)
    with TestClient(app, base_url="http://dashboard.lan:8050") as c:
        assert c.get("/healthz").text == "ok\n"


def test_a_taken_port_is_one_line_and_the_config_exit_code(redis_url, cluster_name):
    cli = typer.Typer()
    cli.command()(dashboard)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = CliRunner().invoke(
            cli, ["--port", str(port), "--redis-url", redis_url, "--cluster", cluster_name]
        )
    assert res.exit_code == ExitCode.CONFIG, res.output
    assert f"could not listen on 127.0.0.1:{port}" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_an_unreachable_redis_is_one_line_and_the_unreachable_exit_code(cluster_name):
    cli = typer.Typer()
    cli.command()(dashboard)
    args = ["--port", "0", "--redis-url", "redis://127.0.0.1:9/0", "--cluster", cluster_name]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == ExitCode.UNREACHABLE, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "redis://127.0.0.1:9/0" in lines[0], res.stderr
    assert "dashboard at" not in res.output


def test_the_service_waits_for_redis_then_names_it(tmp_path):
    argv = [*service_command("dashboard"), "--http-port", "0", "--redis-outage-s", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}
    env["ASTEROID_REDIS_URL"] = "redis://127.0.0.1:9/0"
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == ExitCode.UNREACHABLE, done.stderr
    errors = [line for line in done.stderr.splitlines() if "asteroid-dashboard: error:" in line]
    assert len(errors) == 1 and "redis://127.0.0.1:9/0" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
