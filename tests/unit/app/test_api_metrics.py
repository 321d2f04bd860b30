"""Histogram buckets built from stage durations read out of the database; no Celery at import time."""

from __future__ import annotations

import subprocess
import sys

from pipeline.app.api.metrics import DURATION_BUCKETS_S, _buckets


def test_buckets_are_cumulative_and_end_with_inf() -> None:
    buckets = dict(_buckets([0.05, 0.1, 3.0, 7200.0, 99999.0]))

    assert list(buckets)[-1] == "+Inf" and len(buckets) == len(DURATION_BUCKETS_S) + 1
    assert buckets["0.1"] == 2.0, "a value equal to a bound falls in that bucket (le)"
    assert buckets["5.0"] == 3.0
    assert buckets["14400.0"] == 4.0
    assert buckets["+Inf"] == 5.0
    counts = list(buckets.values())
    assert counts == sorted(counts)


def test_no_samples_give_zero_buckets() -> None:
    assert {count for _, count in _buckets([])} == {0.0}


def test_api_audit_and_signing_import_no_celery() -> None:
    # The stage -> queue table is a plain table: /metrics needs no Celery app.
    code = (
        "import sys\n"
        "import pipeline.app.api.app, pipeline.provenance.audit, pipeline.provenance.signing\n"
        "import pipeline.app.cli\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu', 'workers'))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", result.stdout
