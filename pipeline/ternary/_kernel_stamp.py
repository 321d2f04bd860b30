"""numba's on-disk cache, made stale by the helper files a kernel compiles in, not only by its own.

numba stamps the cached machine code of a function with a hash of the file that defines it. A
kernel split over several files (so that no module passes 450 lines) inlines jitted functions
and LLVM-IR intrinsics from its helper files, and an edit there would leave the cache handing
back code built from the old helper. `depends_on(__file__, "helper.py", ...)`, called at the
top of a kernel module before its first ``@njit(cache=True)``, adds those helpers' hashes to
the stamp of every function that module defines.

It goes through numba's cache-locator hook (``CacheImpl._locator_classes``, not a public API).
Where that hook is missing the kernels still run and cache as before, stamped by their own
file alone.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

__all__ = ["depends_on", "helpers_of"]

_HELPERS: dict[str, tuple[str, ...]] = {}  # a kernel module's real path -> its helpers' real paths


def helpers_of(module_file: str) -> tuple[str, ...]:
    """The helper files whose contents stamp `module_file`'s cached functions (none if unregistered)."""
    return _HELPERS.get(os.path.realpath(module_file), ())


def depends_on(module_file: str, *helpers: str) -> None:
    """Stamp `module_file`'s cached kernels with `helpers` (names relative to its folder) as well."""
    folder = os.path.dirname(os.path.realpath(module_file))
    _HELPERS[os.path.realpath(module_file)] = tuple(os.path.join(folder, name) for name in helpers)
    _install()


def _digest(paths: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for path in paths:
        st = os.stat(path)
        h.update(_file_digest(path, st.st_mtime_ns, st.st_size))
    return h.hexdigest()


@functools.cache
def _file_digest(path: str, mtime_ns: int, size: int) -> bytes:
    """A helper file's hash, read once per process while the file is unchanged (every cached function
    of a kernel asks for its stamp as the module loads: dozens of times)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def _install() -> None:
    try:
        from numba.core import caching
    except ImportError:  # no numba: nothing is compiled, nothing is cached
        return
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    base = getattr(caching, "_CacheLocator", None)
    locators = getattr(impl, "_locator_classes", None)
    if base is None or not isinstance(locators, list):
        return
    if any(getattr(cls, "_bonsai_helpers", False) for cls in locators):
        return
    chain: list[Any] = locators

    class HelperStampedLocator(base):  # type: ignore[misc,valid-type]
        """numba's own locator for the file, with the helpers' digest added to its stamp."""

        _bonsai_helpers = True

        def __init__(self, inner: Any, helpers: tuple[str, ...]) -> None:
            self._inner = inner
            self._helpers = helpers

        def ensure_cache_path(self) -> None:
            self._inner.ensure_cache_path()

        def get_cache_path(self) -> Any:
            return self._inner.get_cache_path()

        def get_disambiguator(self) -> Any:
            return self._inner.get_disambiguator()

        def get_source_stamp(self) -> Any:
            return (self._inner.get_source_stamp(), _digest(self._helpers))

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Any:
            helpers = helpers_of(py_file)
            if not helpers:
                return None
            for other in chain:
                if other is cls:
                    continue
                inner = other.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner, helpers)
            return None

    chain.insert(0, HelperStampedLocator)
