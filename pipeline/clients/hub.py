"""A small, injectable client for the Hugging Face hub.

The download stage talks to the hub only through the `HubClient` protocol, so tests pass a
fake or a real `HfHubClient` pointed at a hand-built cache, and nothing in the stage knows
about huggingface_hub's exception zoo: `HfHubClient` turns every hub failure into one of our
own errors (`InputError` for a repo or revision that does not exist, `UnreachableError` for a
hub no connection can be opened to while the cache has no copy, `TransientError` for a hub that
timed out or answered 5xx).

Usage::

    hub = HfHubClient(cache_dir="/data/hf-cache")
    sha = hub.resolve_revision("org/name", "main")        # 40-char commit sha
    files = hub.list_files_with_sha256("org/name", sha)   # [HubFile(name, size_bytes, sha256)]
    folder = hub.download_snapshot("org/name", sha)       # local snapshot folder
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pipeline.clients.hub_refs import is_commit_sha, repo_id_fault, revision_fault
from pipeline.core.errors import InputError, TransientError, UnreachableError

__all__ = ["HubClient", "HubFile", "HfHubClient", "is_commit_sha"]


@dataclass(frozen=True)
class HubFile:
    """What the hub says about one file of a commit.

    `sha256` is the content sha256 the hub publishes for LFS files; None for small files
    stored in git, whose only id is a git blob sha1 (not a content hash we can check).
    """

    name: str
    size_bytes: int | None
    sha256: str | None = None


class HubClient(Protocol):
    """The three hub operations the download stage needs."""

    def resolve_revision(self, repo_id: str, revision: str | None) -> str:
        """The full commit sha that `revision` (branch, tag, sha; None = default branch) points to."""
        ...

    def list_files_with_sha256(self, repo_id: str, commit_sha: str) -> list[HubFile]:
        """Every file of the commit with its size and, where the hub knows it, content sha256.

        May return an empty list when the listing cannot be had (offline, old cache).
        """
        ...

    def download_snapshot(
        self, repo_id: str, commit_sha: str, allow_patterns: Sequence[str] | None = None
    ) -> Path:
        """A local folder holding the commit's files (those matching `allow_patterns`, when given);
        it may contain symlinks into a cache."""
        ...


class HfHubClient:
    """`HubClient` backed by huggingface_hub (its cache, its offline mode, its token handling).

    `is_offline=None` follows huggingface_hub's own HF_HUB_OFFLINE setting at call time;
    True serves everything from `cache_dir` and never opens a connection.
    """

    def __init__(
        self,
        *,
        cache_dir: str | Path | None = None,
        token: str | bool | None = None,
        is_offline: bool | None = None,
        token_repos: Sequence[str] | None = None,
    ) -> None:
        self._cache_dir = str(cache_dir) if cache_dir is not None else None
        self._token = token
        self._is_offline = is_offline
        self._token_repos = None if token_repos is None else tuple(p.lower() for p in token_repos)

    def _token_for(self, repo_id: str) -> str | bool | None:
        """The credential sent for ``repo_id``: with an allow-list (``token_repos``: orgs or repo globs),
        the token only for the repos it names and ``False`` (anonymous, not even a saved login) for the
        rest, so one submitter cannot borrow the operator's access to a private or gated repo."""
        if self._token_repos is None:
            return self._token
        lowered = repo_id.lower()
        org = lowered.split("/", 1)[0]
        named = any(fnmatch.fnmatchcase(lowered, p) if "/" in p else org == p for p in self._token_repos)
        return self._token if named else False

    def _offline(self) -> bool:
        if self._is_offline is not None:
            return self._is_offline
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)

    def resolve_revision(self, repo_id: str, revision: str | None) -> str:
        """See `HubClient.resolve_revision`; raises InputError or TransientError."""
        from huggingface_hub import HfApi

        _check_names(repo_id, revision)
        with self._translate(repo_id, revision):
            token = self._token_for(repo_id)
            resolved = HfApi(token=token).resolve_revision(
                repo_id,
                revision=revision,
                cache_dir=self._cache_dir,
                local_files_only=self._offline(),
                token=token,
            )
        sha = str(resolved.resolved).strip()
        if not is_commit_sha(sha):
            # What was read is never echoed: it came from a file or an answer, not from the user.
            raise InputError(
                f"hub repo {repo_id!r}: revision {revision or 'main'!r} resolved to something other "
                "than a 40-character commit sha; refusing to pin to it"
            )
        return sha

    def list_files_with_sha256(self, repo_id: str, commit_sha: str) -> list[HubFile]:
        """See `HubClient.list_files_with_sha256`.

        Online this asks the hub's tree listing (it carries the LFS sha256). Offline it reads the
        listing huggingface_hub cached when it downloaded the snapshot, when there is one.
        """
        # A commit's listing never changes: a cached one is as good as the hub's (huggingface_hub's
        # own snapshot_download reads it first too), and it spares a hub that cannot be reached.
        cached = self._cached_listing(repo_id, commit_sha)
        if cached or self._offline():
            return cached
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile

        try:
            with self._translate(repo_id, commit_sha):
                token = self._token_for(repo_id)
                entries = HfApi(token=token).list_repo_tree(
                    repo_id, recursive=True, revision=commit_sha, token=token
                )
                files = [
                    HubFile(
                        name=entry.path,
                        size_bytes=entry.size,
                        sha256=entry.lfs.sha256 if entry.lfs is not None else None,
                    )
                    for entry in entries
                    if isinstance(entry, RepoFile)
                ]
        except UnreachableError:
            return []  # the snapshot may still be cached; download_snapshot says so when it is not
        return sorted(files, key=lambda item: item.name)

    def download_snapshot(
        self, repo_id: str, commit_sha: str, allow_patterns: Sequence[str] | None = None
    ) -> Path:
        """See `HubClient.download_snapshot`; raises InputError or TransientError."""
        from huggingface_hub import snapshot_download

        with self._translate(repo_id, commit_sha):
            folder = snapshot_download(
                repo_id,
                revision=commit_sha,
                cache_dir=self._cache_dir,
                token=self._token_for(repo_id),
                local_files_only=self._offline(),
                allow_patterns=list(allow_patterns) if allow_patterns is not None else None,
                library_name="bonsai-pipeline",
            )
        return Path(folder)

    def _cached_listing(self, repo_id: str, commit_sha: str) -> list[HubFile]:
        # huggingface_hub >= 2.x keeps the hub's tree listing (with LFS sha256) next to the
        # snapshot; its public reader drops the sha256, so read the documented JSON file.
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        cache_dir = Path(self._cache_dir or constants.HF_HUB_CACHE).expanduser()
        tree_path = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model") / "trees"
        tree_path = tree_path / f"{commit_sha}.json"
        try:
            data = json.loads(tree_path.read_text(encoding="utf-8"))
            entries: dict[str, dict[str, Any]] = data["files"]
            return sorted(
                (
                    HubFile(
                        name=name,
                        size_bytes=int(info["size"]),
                        sha256=info.get("lfs_sha256"),
                    )
                    for name, info in entries.items()
                ),
                key=lambda item: item.name,
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []

    @contextlib.contextmanager
    def _translate(self, repo_id: str, revision: str | None) -> Iterator[None]:
        """Turn huggingface_hub and network exceptions into InputError / UnreachableError / TransientError."""
        from huggingface_hub import errors as hf_errors

        where = f"hub repo {repo_id!r} at revision {revision or 'main'!r}"
        try:
            yield
        except hf_errors.RevisionNotFoundError as exc:
            raise InputError(
                f"{where}: the revision does not exist; give a branch, tag or commit sha that does"
            ) from exc
        except hf_errors.GatedRepoError as exc:
            raise InputError(
                f"{where}: the repo is gated; accept its terms on the hub and provide a token "
                "(BONSAI_HF_TOKEN, with the repo or its org listed in BONSAI_HUB_TOKEN_REPOS)"
            ) from exc
        except hf_errors.RepositoryNotFoundError as exc:
            raise InputError(
                f"{where}: no such repo on the hub (or it is private and no valid token was sent for it: "
                "BONSAI_HF_TOKEN, with the repo or its org listed in BONSAI_HUB_TOKEN_REPOS)"
            ) from exc
        except hf_errors.HFValidationError as exc:
            raise InputError(f"{where}: not a valid hub repo id or revision") from exc
        except hf_errors.HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 0
            if status >= 500 or status in (408, 429):
                raise TransientError(f"{where}: the hub answered HTTP {status}; retry later") from exc
            raise InputError(f"{where}: the hub refused the request with HTTP {status}") from exc
        except (
            hf_errors.LocalEntryNotFoundError,
            hf_errors.RevisionResolutionError,
            hf_errors.OfflineModeIsEnabled,
        ) as exc:
            if self._offline():
                # Offline, the cache is all there is: retrying cannot help.
                raise InputError(
                    f"{where}: not in the local hub cache ({self._cache_label()}) and HF_HUB_OFFLINE is on; "
                    f"{_fixes(repo_id, self._cache_label(), offline=True)}"
                ) from exc
            if _connect_failure(exc) is not None:
                raise self._unreachable(where, repo_id, exc) from exc
            raise TransientError(f"{where}: the hub could not be reached in time ({_reason(exc)}); "
                                 "retry later") from exc
        except (ConnectionError, TimeoutError) as exc:
            if _connect_failure(exc) is not None:
                raise self._unreachable(where, repo_id, exc) from exc
            raise TransientError(f"{where}: network failure talking to the hub ({exc})") from exc
        except Exception as exc:
            if _connect_failure(exc) is not None:
                raise self._unreachable(where, repo_id, exc) from exc
            if _is_transport_error(exc):
                raise TransientError(f"{where}: network failure talking to the hub ({exc})") from exc
            raise

    def _cache_label(self) -> str:
        from huggingface_hub import constants

        return str(Path(self._cache_dir or constants.HF_HUB_CACHE).expanduser())

    def _unreachable(self, where: str, repo_id: str, exc: BaseException) -> UnreachableError:
        from huggingface_hub import constants

        cause = _connect_failure(exc)
        return UnreachableError(
            f"{where}: the hub at {constants.ENDPOINT} cannot be reached ({_reason(cause or exc)}) and the "
            f"local hub cache holds no copy; {_fixes(repo_id, self._cache_label())}"
        )


def _check_names(repo_id: str, revision: str | None) -> None:
    """InputError unless both are what `hub_refs` allows: only such names reach huggingface_hub,
    which makes cache paths of them (a job recorded before the grammar existed is checked here too)."""
    fault = repo_id_fault(repo_id) or (revision_fault(revision) if revision is not None else None)
    if fault is not None:
        raise InputError(f"hub repo id or revision refused: {fault}; "
                         "give 'org/name@<branch, tag or commit sha>'")


def _fixes(repo_id: str, cache: str, *, offline: bool = False) -> str:
    """The ways out for a user without the hub, in the order they would try them."""
    switch = "keep HF_HUB_OFFLINE=1" if offline else "set HF_HUB_OFFLINE=1"
    return (f"fix: download it first (`hf download {repo_id}` on a machine that reaches the hub, with its "
            f"cache copied to {cache}) and {switch}, or pass a local folder holding the "
            "checkpoint (`bonsai convert /path/to/model`)")


def _connect_failure(exc: BaseException | None) -> BaseException | None:
    """The link in `exc`'s cause chain that says no connection could be opened at all.

    Connection refused, an unknown host name or no route do not pass in seconds: retrying is a
    storm of identical errors. A timeout or a dropped connection may pass, and stays transient.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionRefusedError | socket.gaierror):
            return exc
        if isinstance(exc, OSError) and exc.errno in _NO_ROUTE:
            return exc
        if type(exc).__name__ == "ConnectError" and type(exc).__module__.split(".")[0] in _HTTP_LIBS:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "…"


_NO_ROUTE = {errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH}
_HTTP_LIBS = {"httpx2", "httpx", "httpcore2", "httpcore"}


def _is_transport_error(exc: BaseException) -> bool:
    """True for the HTTP client's connection and timeout errors (httpx2 in huggingface_hub 2.x)."""
    for module_name in ("httpx2", "httpx", "requests"):
        with contextlib.suppress(ImportError):
            module = __import__(module_name)
            transport = getattr(module, "TransportError", None) or getattr(module, "ConnectionError", None)
            if transport is not None and isinstance(exc, transport):
                return True
    return False
