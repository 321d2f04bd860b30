"""The FastAPI application: job and artifact routes, metrics, OpenAPI, and the web page.

Every data route needs a bearer token (see `pipeline.app.api.auth`), /metrics and
/openapi.json included. Only the web page's static files are public: they hold no
data, and the page asks for a token before it fetches anything. No route loads
anything from outside this machine (no Swagger UI, whose assets come from a CDN).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from pipeline import __version__
from pipeline.app.api import artifacts, history, jobs, publish, session, store, teams
from pipeline.app.api.auth import ApiToken, TokenRedactingFilter, parse_tokens, require_scope
from pipeline.app.api.metrics import make_registry, render_metrics
from pipeline.app.api.rate_limit import rate_limit_for
from pipeline.core.errors import InputError, OverCap, PipelineError
from pipeline.core.settings import Settings
from pipeline.orchestration.runtime import Runtime

__all__ = ["create_app", "WEB_DIR"]

# Module level: with postponed annotations FastAPI resolves them in the module's globals.
Reader = Annotated[ApiToken, Depends(require_scope("read"))]

WEB_DIR = Path(__file__).resolve().parent / "web"

# The page runs only its own script; images may be blob: URLs made from authorised downloads.
_CSP = (
    "default-src 'self'; img-src 'self' blob: data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)


def create_app(settings: Settings, runtime: Runtime | None = None) -> FastAPI:
    """The API over `runtime` (built from `settings` when not given)."""
    from pipeline.provenance.signing import configured_public_key

    if runtime is None:
        from pipeline.orchestration.bootstrap import build_runtime

        runtime = build_runtime(settings)
    launcher = runtime.launcher

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Here, not at import: the server has configured its loggers by the time the app starts.
        access = logging.getLogger("uvicorn.access")
        if not any(isinstance(f, TokenRedactingFilter) for f in access.filters):
            access.addFilter(TokenRedactingFilter())
        yield
        if launcher is not None:
            launcher.shutdown()

    app = FastAPI(
        title="Bonsai Pipeline",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
        description="Submit checkpoints for ternary GGUF conversion and trace every artifact.",
    )
    app.state.settings, app.state.rt, app.state.launcher = settings, runtime, launcher
    app.state.tokens = parse_tokens(settings.api_tokens)
    app.state.rate_limit = rate_limit_for(settings)
    app.state.public_key = configured_public_key(settings.signing_public_key, settings.signing_key)
    app.state.registry = make_registry(runtime.sessions, runtime.teams)
    app.include_router(jobs.router)
    app.include_router(artifacts.router)
    app.include_router(publish.router)
    app.include_router(session.router)
    app.include_router(store.router)
    app.include_router(history.router)
    app.include_router(teams.router)
    _add_service_routes(app)
    _add_web(app)
    _add_error_handlers(app)
    return app


def _add_service_routes(app: FastAPI) -> None:
    @app.get("/healthz", include_in_schema=False)
    def healthz(request: Request) -> dict[str, str]:
        # Liveness for orchestrators: no token, no data, but the database must answer.
        from sqlalchemy import text

        with request.app.state.rt.sessions() as session:
            session.execute(text("SELECT 1"))
        return {"status": "ok"}

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(_token: Reader) -> dict[str, Any]:
        return app.openapi()

    @app.get("/metrics", tags=["service"], summary="Prometheus metrics", response_class=Response)
    def metrics(request: Request, _token: Reader) -> Response:
        return Response(
            render_metrics(request.app.state.registry), media_type="text/plain; version=0.0.4; charset=utf-8"
        )


def _add_web(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", media_type="text/html")

    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")

    @app.middleware("http")
    async def security_headers(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        if request.url.path == "/" or request.url.path.startswith("/web/"):
            response.headers["Content-Security-Policy"] = _CSP
            # A `?token=` page URL must not travel on in Referer headers.
            response.headers["Referrer-Policy"] = "no-referrer"
        return response


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InputError)
    async def input_error(_request: Request, exc: InputError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(OverCap)
    async def over_cap(_request: Request, exc: OverCap) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=429,
                            headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(PipelineError)
    async def pipeline_error(_request: Request, exc: PipelineError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)
