"""A per-token request-rate limit on the API (`BONSAI_API_RATE_LIMIT`, e.g. ``120/minute``), counted by
the `limits` library in Redis when the service has a Redis broker (so every API process shares the
count) and in this process's memory otherwise. Over it a request gets 429 with Retry-After."""

from __future__ import annotations

import logging
import math
import time

from limits import RateLimitItem, parse
from limits.storage import storage_from_string
from limits.strategies import MovingWindowRateLimiter

from pipeline.core.errors import InputError
from pipeline.core.settings import Settings

__all__ = ["RateLimit", "rate_limit_for"]

log = logging.getLogger(__name__)


class RateLimit:
    """``spec`` requests per window and token, counted in the storage at ``storage_url``."""

    def __init__(self, spec: str, storage_url: str) -> None:
        try:
            self.item: RateLimitItem = parse(spec)
        except ValueError:
            raise InputError(f"BONSAI_API_RATE_LIMIT {spec!r} is not a rate; give one like 120/minute or "
                             "10/second (empty: no limit)") from None
        self.spec = spec
        self._limiter = MovingWindowRateLimiter(storage_from_string(storage_url))

    def retry_after_s(self, token_name: str) -> int | None:
        """Count one request of ``token_name``; None while under the limit, else the seconds to wait. A
        storage that cannot be reached lets the request through (the limit protects the service; an
        outage of its counter must not stop it)."""
        try:
            if self._limiter.hit(self.item, "bonsai-api", token_name):
                return None
            stats = self._limiter.get_window_stats(self.item, "bonsai-api", token_name)
        except Exception:  # noqa: BLE001 - fail open, loudly
            log.warning("the API rate limit's counter is unreachable; letting the request through",
                        exc_info=True)
            return None
        return max(1, math.ceil(stats.reset_time - time.time()))


def rate_limit_for(settings: Settings) -> RateLimit | None:
    """The configured limit, counted in Redis when the broker is Redis; None when none is set."""
    if not settings.api_rate_limit:
        return None
    redis = settings.broker_url.startswith(("redis://", "rediss://"))
    return RateLimit(settings.api_rate_limit, settings.broker_url if redis else "memory://")
