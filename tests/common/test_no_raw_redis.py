"""Only `common.store` touches the Redis client: everything else goes through it or the records."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "common" / "store.py"


def raw_client_uses(path: Path, root: Path = ROOT) -> list[str]:
    """Each ``<something>.r`` attribute in `path` (the Store's client), as ``file:line``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.relative_to(root)}:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "r"
    ]


def test_the_scan_finds_a_raw_client_use(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(store):\n    store.get_json('k')\n    return store.r.get('k')\n")
    assert raw_client_uses(sample, tmp_path) == ["sample.py:3"]


def test_no_module_but_the_store_uses_the_raw_client():
    files = sorted((ROOT / "common").rglob("*.py")) + sorted((ROOT / "services").rglob("*.py"))
    uses = [use for path in files if path != OWNER for use in raw_client_uses(path)]
    assert uses == [], "raw Redis client used outside common/store.py: " + ", ".join(uses)
