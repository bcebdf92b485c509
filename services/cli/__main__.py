"""`python -m services.cli` is `asteroid`."""

from services.cli import app

app(prog_name="asteroid")
