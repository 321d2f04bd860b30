"""The q2_0 / q1_0 recipes: block sizes 64 / 128, named fallbacks, and knobs refused with the fix."""

from __future__ import annotations

import pytest

from pipeline.core.errors import InputError
from pipeline.ternary.policy import decide, get_recipe


def test_smaller_groups_take_rows_tq_types_refuse() -> None:
    # Gemma 3 270M's hidden size 640 is not a multiple of 256, but is of 64 and 128.
    for recipe, ggml_type in (("q2_0", "Q2_0"), ("q1_0", "Q1_0")):
        decision = decide("blk.0.attn_q.weight", (1024, 640), get_recipe(recipe))
        assert decision.ggml_type == ggml_type and decision.is_ternary and not decision.is_fallback
    assert decide("blk.0.attn_q.weight", (1024, 640), get_recipe("tq2_0")).is_fallback
    q2 = decide("blk.0.attn_q.weight", (64, 64), get_recipe("q2_0", {"levels": 4}))
    assert q2.reason == "blk.0.attn_q.weight: linear weight [64, 64] -> Q2_0 (optimal fit, 4 levels)"


@pytest.mark.parametrize(("recipe", "cols", "block"), [("q2_0", 96, 64), ("q1_0", 576, 128)])
def test_rows_that_are_not_whole_blocks_are_named_fallbacks(recipe: str, cols: int, block: int) -> None:
    decision = decide("blk.2.ffn_down.weight", (64, cols), get_recipe(recipe))
    ggml_type = recipe.upper()
    assert decision.is_fallback and decision.ggml_type == "F16" and not decision.is_ternary
    assert decision.reason == (
        f"blk.2.ffn_down.weight: row length {cols} is not a multiple of {block} ({ggml_type} block size); "
        "kept as F16"
    )


def test_knobs() -> None:
    assert get_recipe("q2_0").levels == 3
    assert get_recipe("q2_0", {"levels": 4, "method": "absmax"}).method == "absmax"
    assert get_recipe("q1_0", {"method": "absmean", "irls_iters": 0}).method == "absmean"
    with pytest.raises(InputError, match=r"levels=5; expected 3 \(ternary\) or 4"):
        get_recipe("q2_0", {"levels": 5})
    with pytest.raises(InputError, match="levels=4 applies to recipe q2_0 only, not 'q1_0'; remove it"):
        get_recipe("q1_0", {"levels": 4})
    with pytest.raises(InputError, match="not 'tq2_0'"):
        get_recipe("tq2_0", {"levels": 3})
    with pytest.raises(InputError, match="method='absmax' for recipe 'q1_0'; expected one of optimal, absm"):
        get_recipe("q1_0", {"method": "absmax"})
    with pytest.raises(InputError, match="irls_iters=2 does not apply to recipe 'q2_0'.*leave irls_iters"):
        get_recipe("q2_0", {"irls_iters": 2})
    with pytest.raises(InputError, match="levels=True"):
        get_recipe("q2_0", {"levels": True})
