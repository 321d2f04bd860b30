"""`GET /api/session`: what the presented token may do, so the web page shows only what works.

The page asks once after login: a read-only token sees the submit form, retry and cancel
disabled, with the reason and the command that makes a submit token; a submit token also
learns the recipes and stages it can choose and the folders local sources may come from.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from pipeline.app.api.auth import SCOPES, ApiToken, require_scope
from pipeline.core.states import STAGE_INPUTS, STAGE_ORDER

__all__ = ["router", "read_only_reason"]

router = APIRouter(prefix="/api", tags=["session"])

Reader = Annotated[ApiToken, Depends(require_scope("read"))]

DEFAULT_RECIPE = "tq2_0"


def read_only_reason(token: ApiToken) -> str | None:
    """Why this token cannot submit, retry or cancel (None when it can)."""
    if token.allows("submit"):
        return None
    return (
        f"token {token.name!r} has the read scope only: submitting, retrying and cancelling jobs need a "
        "token with the submit scope (make one with `bonsai api-token NAME --scope submit` and add its "
        "entry to BONSAI_API_TOKENS)"
    )


@router.get("/session", summary="The token's name and scopes, and what the page may offer it")
def session(request: Request, token: Reader) -> dict[str, Any]:
    from pipeline.ternary.policy import RECIPES

    can_submit = token.allows("submit")
    settings = request.app.state.settings
    return {
        "token": token.name,
        "scopes": [scope for scope in SCOPES if token.allows(scope)],
        "can_submit": can_submit,
        # Retry and cancel apply to the jobs this token submitted, or to every job with admin.
        "actor": token.actor,
        "is_admin": token.allows("admin"),
        "read_only_reason": read_only_reason(token),
        "recipes": sorted(RECIPES),
        "default_recipe": DEFAULT_RECIPE,
        # In the graph's order (each stage after its inputs), with each stage's inputs for the lineage.
        "stages": [stage.value for stage in STAGE_ORDER],
        "stage_inputs": {stage.value: [i.value for i in STAGE_INPUTS[stage]] for stage in STAGE_ORDER},
        # Where local sources may come from (hub ids always work); only for those who may submit.
        "source_roots": [str(root) for root in settings.source_root_list] if can_submit else [],
    }
