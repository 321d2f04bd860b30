"""`python -m pipeline` is the `bonsai` command."""

from pipeline.app.cli import main

main()
