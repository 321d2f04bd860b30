"""Bearer tokens for the HTTP API: configured as sha256 hashes, checked per route scope.

`BONSAI_API_TOKENS` is a comma-separated list of ``name:scopes:sha256hex[:team]`` entries,
scopes joined by ``+`` (``read``, ``submit``, ``admin``); a token that names no team is a team of
its own (`core.teams`). Only hashes are configured, so the
settings file or environment never holds a usable token. A ``submit`` token may also
read: whoever can change jobs can see them. A ``submit`` token changes (retries, cancels,
publishes) only the jobs it submitted; ``admin`` changes any job.

A request without a valid token gets 401 (with ``WWW-Authenticate: Bearer``); a valid
token without the route's scope gets 403.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from pipeline.core.errors import InputError
from pipeline.core.teams import team_of

__all__ = [
    "ApiToken",
    "SCOPES",
    "hash_token",
    "new_token",
    "parse_tokens",
    "require_scope",
    "redact_token_query",
    "TokenRedactingFilter",
]

SCOPES = ("read", "submit", "admin")
# What each scope also grants.
_IMPLIED = {"submit": {"read"}, "admin": {"submit", "read"}}

_QUERY_PARAM = re.compile(r"([?&])([^=&#\s]*)=([^&#\s]*)")

_bearer = HTTPBearer(auto_error=False, description="A token from `bonsai api-token NAME`.")


@dataclass(frozen=True)
class ApiToken:
    """A configured token: who it belongs to, what it may do, and the sha256 of its secret."""

    name: str
    scopes: frozenset[str]
    sha256: str
    # The team its jobs count against; None: a team of its own (its actor).
    team: str | None = None

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or any(scope in _IMPLIED.get(s, ()) for s in self.scopes)

    @property
    def actor(self) -> str:
        """How this token is recorded on what it does: a job's submitter, a retry's requester."""
        return f"api:{self.name}"

    def may_change(self, submitted_by: str | None) -> bool:
        """Whether this token may retry, cancel or publish a job ``submitted_by`` someone."""
        return self.allows("admin") or (self.allows("submit") and submitted_by == self.actor)

    @property
    def team_name(self) -> str:
        """The team this token acts for."""
        return team_of(self.actor, self.team)


def hash_token(token: str) -> str:
    """The hex sha256 of a token's text, as configured in BONSAI_API_TOKENS."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token(name: str, scopes: tuple[str, ...], team: str | None = None) -> tuple[str, str]:
    """A fresh random token and its BONSAI_API_TOKENS entry (the entry holds only the hash)."""
    token = "bonsai_" + secrets.token_urlsafe(32)
    entry = f"{name}:{'+'.join(sorted(set(scopes)))}:{hash_token(token)}"
    return token, f"{entry}:{team}" if team else entry


def parse_tokens(spec: str) -> list[ApiToken]:
    """Parse BONSAI_API_TOKENS; InputError names the entry at fault."""
    tokens = []
    for index, entry in enumerate((e.strip() for e in spec.split(",")), 1):
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) not in (3, 4):
            raise InputError(
                f"BONSAI_API_TOKENS entry {index} must look like name:scopes:sha256hex or "
                f"name:scopes:sha256hex:team (got {len(parts)} field(s)); make one with "
                "`bonsai api-token NAME`"
            )
        name, scope_text, digest = (p.strip() for p in parts[:3])
        team = parts[3].strip() if len(parts) == 4 else ""
        if len(parts) == 4 and not team:
            raise InputError(f"BONSAI_API_TOKENS entry {index} ({name}): the fourth field names the token's "
                             "team and may not be empty; drop it for a team of the token's own")
        scopes = frozenset(s for s in scope_text.split("+") if s)
        unknown = sorted(scopes - set(SCOPES))
        if not name or not scopes or unknown:
            raise InputError(
                f"BONSAI_API_TOKENS entry {index} ({name or 'no name'}): scopes {scope_text!r} "
                f"must be {' or '.join(SCOPES)}, joined by '+'"
            )
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
            raise InputError(
                f"BONSAI_API_TOKENS entry {index} ({name}): the third field must be the token's "
                "sha256 in hex, never the token itself"
            )
        tokens.append(ApiToken(name, scopes, digest.lower(), team or None))
    return tokens


def _lookup(tokens: list[ApiToken], presented: str) -> ApiToken | None:
    digest = hash_token(presented)
    found = None
    for token in tokens:
        # Compare against every entry in constant time: no early exit that timing could reveal.
        if hmac.compare_digest(token.sha256, digest):
            found = token
    return found


def require_scope(scope: str) -> Callable[..., ApiToken]:
    """A FastAPI dependency that returns the caller's token, or answers 401/403."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}")

    def check(
        request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
    ) -> ApiToken:
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "a bearer token is required",
                headers={"WWW-Authenticate": "Bearer"},
            )
        token = _lookup(request.app.state.tokens, credentials.credentials)
        if token is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "unknown token",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )
        _check_rate(request, token)
        if not token.allows(scope):
            message = f"token {token.name!r} lacks the {scope!r} scope"
            _record_refusal(request, token, message)
            raise HTTPException(status.HTTP_403_FORBIDDEN, message)
        return token

    return check


def _check_rate(request: Request, token: ApiToken) -> None:
    """429 with Retry-After once ``token`` is over BONSAI_API_RATE_LIMIT."""
    limit = getattr(request.app.state, "rate_limit", None)
    if limit is None:
        return
    wait_s = limit.retry_after_s(token.name)
    if wait_s is not None:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS,
                            f"token {token.name!r} is over the API's rate limit of {limit.spec} per token; "
                            f"retry after {wait_s} s", headers={"Retry-After": str(wait_s)})


def _record_refusal(request: Request, token: ApiToken, message: str) -> None:
    """A scope refusal is one row of the action account: who tried what."""
    from pipeline.db import actions
    from pipeline.db.session import session_scope

    rt = getattr(request.app.state, "rt", None)
    if rt is None:
        return
    with session_scope(rt.sessions) as session:
        actions.record(session, token.actor, "refused", f"{request.method} {request.url.path}",
                       outcome=message, team=token.team_name)


def redact_token_query(text: str) -> str:
    """`text` with the value of any `token` query parameter replaced by `***`; the name is compared
    after percent-decoding (``%74oken`` is ``token`` to the server, so it is to the log too)."""

    def redact(match: re.Match[str]) -> str:
        name = urllib.parse.unquote_plus(match.group(2)).strip().lower()
        return f"{match.group(1)}{match.group(2)}=***" if name == "token" else match.group(0)

    return _QUERY_PARAM.sub(redact, text)


class TokenRedactingFilter(logging.Filter):
    """Keeps a page link's `?token=` out of access logs (uvicorn logs the full request path)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_token_query(a) if isinstance(a, str) else a for a in record.args)
        return True
