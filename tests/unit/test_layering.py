"""Stage logic must not import orchestration: the layering rule of STYLE.md, enforced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stage_modules_import_no_celery_or_sqlalchemy() -> None:
    code = (
        "import importlib, sys\n"
        "from pipeline.core.states import StageName\n"
        "for stage in StageName:\n"
        "    importlib.import_module(f'pipeline.stages.{stage.value}')\n"
        "import pipeline.ternary, pipeline.formats\n"
        "orchestration = ('celery', 'sqlalchemy', 'kombu', 'redis')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in orchestration)\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"stage logic imported orchestration modules: {result.stdout}"
