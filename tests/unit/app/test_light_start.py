"""A light start (issue 14): heavy libraries load only where a stage needs them, Alembic only to migrate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.db import migrate
from pipeline.db.session import make_engine

_ROOT = Path(__file__).resolve().parents[3]


def _loaded_after(code: str, modules: tuple[str, ...]) -> dict[str, bool]:
    """Which of `modules` a fresh interpreter has loaded after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {modules!r}}}))\n"
    path = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", probe], cwd=_ROOT, capture_output=True, text=True, check=True,
                         env=env)
    result: dict[str, bool] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_script_head_matches_alembic() -> None:
    from alembic.script import ScriptDirectory

    expected = ScriptDirectory.from_config(migrate.alembic_config("sqlite://")).get_current_head()
    assert migrate.script_head() == expected


def test_script_head_gives_up_on_a_branch(tmp_path: Path) -> None:
    scripts = (("a.py", "0001", "None"), ("b.py", "0002", "'0001'"), ("c.py", "0003", "'0001'"))
    for name, revision, down in scripts:
        (tmp_path / name).write_text(f"revision: str = '{revision}'\ndown_revision: str | None = {down}\n")
    assert migrate.script_head(tmp_path) is None  # two heads: the caller asks Alembic
    (tmp_path / "c.py").write_text("revision = '0003'\ndown_revision = '0002'\n")
    migrate.script_head.cache_clear()
    assert migrate.script_head(tmp_path) == "0003"


def test_is_current_follows_the_stored_revision(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'bonsai.db'}")
    try:
        assert migrate.current_revision(engine) is None and not migrate.is_current(engine)
        migrate.upgrade(engine)
        assert migrate.current_revision(engine) == migrate.script_head() and migrate.is_current(engine)
        migrate.downgrade(engine, "-1")
        assert not migrate.is_current(engine)
    finally:
        engine.dispose()


def test_a_home_starts_without_alembic_or_torch(tmp_path: Path) -> None:
    setup = ("import pipeline.orchestration.bootstrap as b, pipeline.core.settings as s\n"
             f"b.build_runtime(s.Settings(home={str(tmp_path)!r}))\n")
    # A new home's SQLite file is created at the current schema (migrations: an older file only).
    first = _loaded_after(setup, ("alembic",))
    assert first == {"alembic": False}
    engine = make_engine(f"sqlite:///{tmp_path / 'bonsai.db'}")
    try:
        assert migrate.is_current(engine) and migrate.schema_drift(engine) == []
        migrate.downgrade(engine, "-1")  # an older home: migrated up by Alembic
        assert _loaded_after(setup, ("alembic",)) == {"alembic": True} and migrate.is_current(engine)
    finally:
        engine.dispose()
    heavy = ("alembic", "torch", "numba", "llama_cpp", "celery")
    again = _loaded_after(setup + "import pipeline.app.convert, pipeline.stages.decompose as d\n"
                          "from pipeline.stages.base import JobSpec\n"
                          "d.make_params(JobSpec('x', 'tq2_0', {}))\n"
                          # The output's name is worked out before the first stage: no stage's libraries.
                          "import types, pipeline.stages.package.stage\n"
                          "pipeline.app.convert.output_name(types.SimpleNamespace(source='x', "
                          "recipe='tq2_0', params={}))\n", heavy)
    assert again == dict.fromkeys(heavy, False)


def test_embedded_runs_load_decompose_libraries_in_the_background() -> None:
    # What run_job warms must be importable, and must be what decompose needs (torch, the kernels).
    loaded = _loaded_after("import pipeline.orchestration.embedded as e\ne.warm_up().join()\n",
                           ("torch", "pipeline.stages.conversion.shard", "pipeline.ternary.kernel"))
    assert loaded == {"torch": True, "pipeline.stages.conversion.shard": True,
                      "pipeline.ternary.kernel": True}


def test_the_background_warm_up_loads_the_jobs_cached_kernel_and_compiles_nothing() -> None:
    pytest.importorskip("numba", reason="the compiled kernel needs numba")
    # Make sure the TQ kernel's variants are in numba's cache (a cold machine compiles them here, once).
    _loaded_after("from pipeline.ternary import kernel_cache\nkernel_cache.warm_up()\n", ())
    code = (
        "import pipeline.orchestration.embedded as e\ne.warm_up('TQ2_0').join()\n"
        "from pipeline.ternary import _kernel_tq_impl as k\nd = k.fit_pack_all\n"
        "assert len(d.overloads) >= 2, d.overloads\n"  # the bf16 and float32 variants, loaded
        "assert sum(d._cache_misses.values()) == 0, d._cache_misses\n"  # none compiled
        "assert sum(d._cache_hits.values()) == len(d.overloads)\n"
    )
    assert _loaded_after(code, ("numba",)) == {"numba": True}


def test_a_type_without_a_kernel_warms_only_the_libraries() -> None:
    from pipeline.ternary import kernel_cache

    assert kernel_cache.load_cached("F16") == 0
    loaded = _loaded_after("import pipeline.orchestration.embedded as e\ne.warm_up('F16').join()\n",
                           ("torch", "pipeline.ternary._kernel_tq_impl"))
    assert loaded == {"torch": True, "pipeline.ternary._kernel_tq_impl": False}


def test_calibrate_loads_torch_only_after_its_source_started_running() -> None:
    # An embedded job warms torch in a background thread; calibrate's module must not wait for it
    # before the source's llama.cpp child is on its way (torch builds the reference afterwards).
    loaded = _loaded_after("import pipeline.stages.calibrate, pipeline.stages.calibrate.source_gguf\n",
                           ("torch", "llama_cpp"))
    assert loaded == {"torch": False, "llama_cpp": False}
