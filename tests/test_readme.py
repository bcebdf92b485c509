from pathlib import Path

from common.config_docs import settings_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_settings_table_matches_settings_models():
    text = README.read_text()
    embedded = text.split("<!-- settings:begin -->\n")[1].split("\n<!-- settings:end -->")[0]
    assert embedded.strip() == settings_table().strip(), "regenerate with common.config_docs"
