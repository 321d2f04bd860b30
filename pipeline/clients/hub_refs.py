"""The grammar of hub repo ids and revisions: what may reach huggingface_hub as a name.

huggingface_hub joins a revision onto its cache's ``refs/`` folder and, offline or when the hub
cannot be reached, reads that file; an absolute path or ``..`` in a revision would make it read
any file the process can. So a revision is either a full commit sha or a ref name by git's own
rules (`git check-ref-format --allow-onelevel`), and nothing else is ever passed on.
"""

from __future__ import annotations

import re

__all__ = ["MAX_REVISION_CHARS", "REPO_ID", "is_commit_sha", "revision_fault", "repo_id_fault"]

MAX_REVISION_CHARS = 200
_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
# git check-ref-format, rules 4, 5 and 10: no control character, space, ~ ^ : ? * [ or backslash.
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")


def is_commit_sha(revision: str) -> bool:
    """True for a full 40-character lowercase hex commit sha (the only pin that cannot move)."""
    return bool(_COMMIT_SHA.fullmatch(revision))


def revision_fault(revision: str) -> str | None:
    """Why ``revision`` is not a commit sha nor a git ref name, or None when it is one."""
    if is_commit_sha(revision):
        return None
    if not revision:
        return "it is empty"
    if len(revision) > MAX_REVISION_CHARS:
        return f"it is over {MAX_REVISION_CHARS} characters"
    if _REF_FORBIDDEN.search(revision):
        return "it holds a space, a control character or one of ~ ^ : ? * [ \\"
    if revision.startswith("/") or revision.endswith("/") or "//" in revision:
        return "it starts or ends with '/' or holds '//'"
    if ".." in revision or "@{" in revision or revision == "@" or revision.endswith("."):
        return "it holds '..' or '@{', ends with '.', or is '@'"
    if any(part.startswith(".") or part.endswith(".lock") for part in revision.split("/")):
        return "a part of it starts with '.' or ends with '.lock'"
    return None


def repo_id_fault(repo_id: str) -> str | None:
    """Why ``repo_id`` is not a hub repo id ``org/name``, or None when it is one."""
    if not REPO_ID.fullmatch(repo_id):
        return "it is not 'org/name' of letters, digits, '.', '_' and '-'"
    # The hub forbids these in repo names; refusing early gives a clearer message than a 404.
    if "--" in repo_id or ".." in repo_id or repo_id.endswith((".", "-")):
        return "it holds '--' or '..' or ends with '.' or '-'"
    return None
