"""The `bonsai` command line: one click group (`main.cli`) and its commands, module by concern."""

from __future__ import annotations

from pipeline.app.cli import export, jobs, provenance, service  # noqa: F401 - importing registers the commands
from pipeline.app.cli.main import cli

__all__ = ["cli", "main"]


def main() -> None:
    cli(prog_name="bonsai")
