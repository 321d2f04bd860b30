"""The `bonsai` command line: one click group (`main.cli`) and its commands, module by concern."""

from __future__ import annotations

import os

from pipeline.app.cli import attempts, export, jobs, provenance, service, store  # noqa: F401 - importing registers the commands
from pipeline.app.cli.main import cli, exit_now

__all__ = ["cli", "main"]


def main() -> None:
    # OpenMP's idle threads (torch, llama.cpp) sleep rather than spin on the cores the next stage needs.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        cli(prog_name="bonsai")
    except SystemExit as exc:
        exit_now(exc.code)
    exit_now(0)
