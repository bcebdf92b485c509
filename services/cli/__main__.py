"""`python -m services.cli` is `asteroid`."""

from services.cli import main

main()
