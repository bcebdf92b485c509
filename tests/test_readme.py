import re
from pathlib import Path

from common.config_docs import SECTIONS, render

README = Path(__file__).resolve().parent.parent / "README.md"


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_reference_tables_match_the_settings_and_job_models():
    text = README.read_text()
    assert set(SECTIONS) == {"settings", "job"}
    assert render(text) == text, "regenerate: python -m common.config_docs README.md"


def test_first_screen_gives_the_quick_start_then_the_test_command():
    text = README.read_text()
    first_screen = text.split("\n---\n", 1)[0]
    assert bash_blocks(first_screen) == ["make demo", "make install && make test"]
    assert len(first_screen.splitlines()) <= 30
