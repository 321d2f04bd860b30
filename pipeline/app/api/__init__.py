"""HTTP API (FastAPI) and the web page it serves; `bonsai serve` runs it."""

from __future__ import annotations

__all__ = ["create_app"]


def __getattr__(name: str) -> object:
    # Lazy: `import pipeline.app.api.auth` (say, for `bonsai api-token`) should not build the app module.
    if name == "create_app":
        from pipeline.app.api.app import create_app

        return create_app
    raise AttributeError(name)
