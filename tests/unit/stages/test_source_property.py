"""Property: no source a submitter can write makes the process open a file outside the hub cache and
the allowed folders, and every refusal is an InputError with a message (issue 24, deliver 1).

The source is checked as the API checks it (`SourcePolicy` limited to roots) and, when it is taken
as a hub id, resolved by the real hub client over a real offline cache, which is where a revision
once became a path. ``sys.addaudithook`` sees every ``open`` the process makes meanwhile.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.clients.hub import HfHubClient
from pipeline.core.errors import InputError, PipelineError
from pipeline.stages.sources import SourcePolicy
from tests.support.hub_cache import build_hub_cache

_opened: list[str] = []
_watching = threading.local()


def _audit(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and getattr(_watching, "on", False) and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # hooks cannot be removed; this one records only while a test watches

_PIECES = st.sampled_from([
    "org/name", "acme/tiny-llama", "@", "/", "..", ".", "~", "\\", "@{", "refs/", "main", "%2e%2e", "\x00",
    "\x1b[2J", "/proc/self/environ", "/etc/passwd", "ENVIRON", "MODELS", "hf://", " ", "\u202e", ".lock",
    ":", "*", "a" * 300,
])
_SOURCES = st.lists(st.one_of(_PIECES, st.text(max_size=8)), min_size=1, max_size=8).map("".join)


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("property")
    cache, models = root / "hub", root / "models"
    build_hub_cache(cache, {"config.json": b"{}"})
    (models / "llama").mkdir(parents=True)
    (root / "environ").write_text("AWS_SECRET_ACCESS_KEY=planted")
    # Warm up: huggingface_hub's lazy imports open code files on a first call, not data.
    hub = HfHubClient(cache_dir=cache, is_offline=True)
    hub.resolve_revision("acme/tiny-llama", "main")
    with pytest.raises(InputError):
        hub.resolve_revision("acme/tiny-llama", "missing")
    return root, cache, models


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=_SOURCES)
def test_no_source_opens_a_file_outside_the_cache_and_roots(layout: tuple[Path, Path, Path],
                                                            raw: str) -> None:
    root, cache, models = layout
    source = raw.replace("ENVIRON", str(root / "environ")).replace("MODELS", str(models))
    policy = SourcePolicy.from_roots([str(models)], allow_any_local=False)
    hub = HfHubClient(cache_dir=cache, is_offline=True)
    _opened.clear()
    _watching.on = True
    try:
        spec = policy.check(source)
        if spec.kind == "hub":
            assert spec.repo_id is not None
            hub.resolve_revision(spec.repo_id, spec.revision)
    except InputError as exc:
        assert str(exc).strip()
        assert "planted" not in str(exc)
    except PipelineError as exc:  # the hub client's own refusals (unreachable offline) are fine too
        assert "planted" not in str(exc)
    finally:
        _watching.on = False
    allowed = (str(cache.resolve()), str(models.resolve()))
    code = (sys.prefix, sys.base_prefix)  # a module imported late is code, not a file a source named
    strays = [path for path in _opened
              if not os.path.realpath(path).startswith(allowed) and not path.startswith(code)]
    assert not strays, (source, strays)
