"""`python -m pipeline` is the `bonsai` command."""

from pipeline.cli import main

main()
