"""The layers of STYLE.md, enforced on the source: each folder imports only the folders below it.

Every import is read from the syntax tree, the lazy ones inside functions included, so a
shortcut through a function-level import is caught too. Besides the layer table: no two
modules import each other (directly or round a longer circle), no module outgrows ~400
lines unless it is a table, and stage logic loads without the orchestration libraries.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipeline"

# Layer of each top-level folder of pipeline/, and the layers it may import (besides its own).
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "formats": {"core"},
    "ternary": {"core", "formats"},
    "clients": {"core"},
    "demo": {"core", "formats"},
    "calibration": {"core", "formats", "ternary"},
    "stages": {"core", "formats", "ternary", "clients", "calibration"},
    "publish": {"core", "formats"},
    "artifacts": {"core"},
    "db": {"core"},
    "provenance": {"core", "db", "artifacts"},
    "orchestration": {"core", "formats", "ternary", "clients", "calibration", "stages", "artifacts", "db",
                      "provenance"},
    "app": {"core", "formats", "ternary", "clients", "calibration", "demo", "stages", "publish", "artifacts",
            "db", "provenance", "orchestration"},
}
# Third-party libraries that belong to orchestration and above: stage logic must not need them.
ORCHESTRATION_LIBS = {"celery", "kombu", "redis", "sqlalchemy", "alembic", "fastapi", "uvicorn"}
LOWER_LAYERS = {"core", "formats", "ternary", "clients", "calibration", "demo", "stages", "publish"}
# Files allowed past the size limit, each with the reason.
# None: the numba kernels are split too, each stamping its cache with its helper files (`_kernel_stamp`).
LONG_FILES: dict[str, int] = {}
MAX_LINES = 400


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        yield ".".join(parts), path


def _imports(module: str, path: Path) -> Iterator[str]:
    """Every module name `path` imports, absolute, lazy imports included."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            for alias in node.names:
                yield f"{base}.{alias.name}"  # `from pipeline.x import y` may import module x.y


def _graph() -> dict[str, set[str]]:
    modules = dict(_modules())
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in _imports(module, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else None


def test_every_folder_is_a_known_layer() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(ALLOWED), "a new folder in pipeline/ needs a row in ALLOWED (its layer)"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert loose == [], f"modules outside the layer folders: {loose}"


def test_each_layer_imports_only_layers_below_it() -> None:
    problems = []
    for module, targets in _graph().items():
        layer = _layer(module)
        if layer is None:
            continue
        for target in sorted(targets):
            other = _layer(target)
            if other is not None and other != layer and other not in ALLOWED[layer]:
                problems.append(f"{module} ({layer}) imports {target} ({other})")
    assert problems == []


# Shared by every stage: the protocol and contracts (base), the source grammar (sources), the GGUF
# writer that package runs and decompose's auto search scores (gguf_build), the fitting and candidate
# files that decompose and the measured sensitivity both run (conversion); and above them all, the
# job options table made from every stage's declarations (options), which no stage reads.
_STAGE_COMMONS = {"base", "sources", "gguf_build", "conversion", "options"}


def test_no_stage_imports_another_stage() -> None:
    problems = []
    for module, targets in _graph().items():
        parts = module.split(".")
        if parts[:2] != ["pipeline", "stages"] or len(parts) < 3 or parts[2] in _STAGE_COMMONS:
            continue
        for target in sorted(targets):
            other = target.split(".")
            if other[:2] == ["pipeline", "stages"] and len(other) > 2 and other[2] not in _STAGE_COMMONS \
                    and other[2] != parts[2]:
                problems.append(f"{module} imports {target}")
    assert problems == []


def test_nothing_in_pipeline_imports_the_workers_entry_package() -> None:
    bad = [m for m, path in _modules() for name in _imports(m, path) if name.split(".")[0] == "workers"]
    assert bad == []


def test_lower_layers_never_name_orchestration_libraries() -> None:
    bad = []
    for module, path in _modules():
        if _layer(module) in LOWER_LAYERS:
            bad += [f"{module} imports {name}" for name in _imports(module, path)
                    if name.split(".")[0] in ORCHESTRATION_LIBS]
    assert bad == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles() -> None:
    # A package __init__ that re-exports its own submodules is not a circle of two files that
    # need each other: drop the edges from a package to its own children.
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in _graph().items()}
    assert _cycles(graph) == []


def _package_of(module: str) -> str:
    # pipeline.<layer>.<package>.<module> -> pipeline.<layer>.<package>; shallower names stay.
    return ".".join(module.split(".")[:3])


def test_no_circles_between_packages_of_stage_logic() -> None:
    # A sub-package is one unit to the modules beside it: `ternary.codecs` may use `ternary.kernel`,
    # or the kernel the codecs, never both (the per-module check above misses a loop that runs
    # through a package's __init__ into one of its children). Orchestration is left out: its
    # `distributed` package holds both the dispatcher bootstrap uses and the worker entry above it.
    graph: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        if _layer(module) not in LOWER_LAYERS:
            continue
        node = _package_of(module)
        graph.setdefault(node, set()).update(_package_of(t) for t in targets if _package_of(t) != node)
    # `from pipeline.ternary import kernel` names the layer's own (empty) __init__ too: not an edge.
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    assert _cycles(graph) == []


def test_modules_stay_small() -> None:
    too_long = []
    for _module, path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        n_lines = len(path.read_text(encoding="utf-8").splitlines())
        if n_lines > LONG_FILES.get(rel, MAX_LINES):
            too_long.append(f"{rel}: {n_lines} lines")
    assert too_long == []


def test_stage_modules_load_without_orchestration_libraries() -> None:
    code = (
        "import importlib, sys\n"
        "from pipeline.core.states import StageName\n"
        "for stage in StageName:\n"
        "    importlib.import_module(f'pipeline.stages.{stage.value}')\n"
        "import pipeline.ternary, pipeline.formats\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(ORCHESTRATION_LIBS)!r})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"stage logic imported orchestration modules: {result.stdout}"
