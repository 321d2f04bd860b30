"""A kernel split over files must not run cached machine code built from an old copy of a helper."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("numba", reason="the stamp only matters to numba's cache")

ROOT = Path(__file__).resolve().parents[3]

_HELPER = """
from numba import njit


@njit(inline="always")
def value():
    return {value}
"""

_KERNEL = """
from numba import njit

from helper import value
from pipeline.ternary import _kernel_stamp

_kernel_stamp.depends_on(__file__, "helper.py")


@njit(cache=True)
def run():
    return value()
"""


def _run(folder: Path) -> tuple[int, int, int]:
    """(the kernel's answer, cache hits, cache misses) in a fresh interpreter."""
    code = ("import kern\n"
            "print(kern.run(), sum(kern.run._cache_hits.values()), sum(kern.run._cache_misses.values()))")
    env = {"PYTHONPATH": f"{folder}:{ROOT}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    answer, hits, misses = done.stdout.split()
    return int(answer), int(hits), int(misses)


def test_an_edited_helper_makes_the_kernels_cache_stale(tmp_path: Path) -> None:
    (tmp_path / "helper.py").write_text(textwrap.dedent(_HELPER.format(value=1)))
    (tmp_path / "kern.py").write_text(textwrap.dedent(_KERNEL))
    assert _run(tmp_path) == (1, 0, 1)  # compiled and cached
    assert _run(tmp_path) == (1, 1, 0)  # loaded from the cache
    (tmp_path / "helper.py").write_text(textwrap.dedent(_HELPER.format(value=2)))
    assert _run(tmp_path) == (2, 0, 1)  # the helper changed: compiled again, not the old code


def test_the_real_kernels_are_stamped_with_their_helpers() -> None:
    from pipeline.ternary import _kernel_q_impl, _kernel_q_sorted, _kernel_stamp, _kernel_tq_impl

    names = {mod.__name__: sorted(Path(p).name for p in _kernel_stamp.helpers_of(mod.__file__))
             for mod in (_kernel_tq_impl, _kernel_q_impl, _kernel_q_sorted)}
    assert names == {
        "pipeline.ternary._kernel_tq_impl": ["_kernel_ir.py", "_kernel_sums.py"],
        "pipeline.ternary._kernel_q_impl": ["_kernel_ir.py", "_kernel_q_sorted.py", "_kernel_sums.py"],
        "pipeline.ternary._kernel_q_sorted": ["_kernel_ir.py"],
    }
    stamp = _kernel_tq_impl.fit_pack_all._cache._cache_file._source_stamp
    assert isinstance(stamp, tuple) and len(stamp) == 2  # numba's own stamp, and the helpers' digest
