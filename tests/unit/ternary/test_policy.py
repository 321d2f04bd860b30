"""The tensor-type policy: every decision is named, every fallback says why."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.core.errors import InputError
from pipeline.ternary.policy import RECIPES, SOURCE_16, decide, get_recipe


@pytest.mark.parametrize("kind", ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                  "ffn_down"])
def test_linear_weights_go_ternary(kind: str) -> None:
    decision = decide(f"blk.3.{kind}.weight", (512, 768), get_recipe("tq2_0"))
    assert decision.ggml_type == "TQ2_0" and decision.is_ternary and not decision.is_fallback
    assert decide(f"blk.3.{kind}.weight", (512, 768), get_recipe("tq1_0")).ggml_type == "TQ1_0"


def test_bad_row_length_is_a_named_fallback() -> None:
    decision = decide("blk.0.ffn_down.weight", (256, 640), get_recipe("tq2_0"))
    assert decision == decision.__class__(
        "F16", False,
        "blk.0.ffn_down.weight: row length 640 is not a multiple of 256 (TQ2_0 block size); kept as F16",
        is_fallback=True,
    )


def test_embeddings_output_norms() -> None:
    recipe = get_recipe("tq2_0")
    assert decide("token_embd.weight", (1000, 640), recipe).ggml_type == "F16"
    assert decide("output.weight", (1000, 640), recipe).ggml_type == "F16"
    norm = decide("blk.0.attn_norm.weight", (640,), recipe)
    assert norm.ggml_type == "F32" and not norm.is_fallback and "blk.0.attn_norm.weight" in norm.reason
    q8 = get_recipe("tq2_0", {"embed_type": "Q8_0", "output_type": "Q8_0"})
    assert decide("token_embd.weight", (1000, 640), q8).ggml_type == "Q8_0"
    odd = decide("output.weight", (1000, 100), q8)
    assert odd.ggml_type == "F16" and odd.is_fallback and "output.weight" in odd.reason and "32" in odd.reason


def test_unknown_2d_tensor_is_a_named_fallback() -> None:
    decision = decide("blk.1.attn_foo.weight", (256, 256), get_recipe("tq2_0"))
    assert decision.is_fallback and decision.ggml_type == "F16"
    assert decision.reason.startswith("blk.1.attn_foo.weight: not a block linear weight")


def test_every_fallback_has_its_name() -> None:
    recipe = get_recipe("tq1_0")
    cases = [("blk.0.attn_q.weight", (640, 640)), ("blk.0.ffn_up.weight", (4, 4, 256)),
             ("pos.weight", (8, 8))]
    for name, shape in cases:
        decision = decide(name, shape, recipe)
        assert decision.is_fallback and not decision.is_ternary and decision.reason.startswith(f"{name}:")


def test_recipes_and_knobs() -> None:
    assert set(RECIPES) == {"tq2_0", "tq1_0", "q2_0", "q1_0", "auto"}
    recipe = get_recipe("tq2_0", {"method": "absmean", "irls_iters": 3, "unrelated": "ignored"})
    assert (recipe.method, recipe.irls_iters, recipe.ternary_type) == ("absmean", 3, "TQ2_0")
    with pytest.raises(InputError, match="known recipes: auto, q1_0, q2_0, tq1_0, tq2_0"):
        get_recipe("q4_k")
    with pytest.raises(InputError, match="method='fast'.*optimal"):
        get_recipe("tq2_0", {"method": "fast"})
    with pytest.raises(InputError, match="irls_iters"):
        get_recipe("tq2_0", {"irls_iters": -1})


def test_plain_tensors_keep_the_sources_own_16_bit_type_by_default() -> None:
    recipe = get_recipe("tq2_0")
    assert recipe.embed_type == recipe.output_type == recipe.fallback_type == SOURCE_16
    for name, shape in (("token_embd.weight", (1000, 640)), ("output.weight", (1000, 640)),
                        ("blk.0.ffn_down.weight", (256, 640))):
        kept = decide(name, shape, recipe, "BF16")
        assert kept.ggml_type == "BF16" and "BF16" in kept.reason, name
        for other in ("F16", "F32", "Q4_K", ""):
            assert decide(name, shape, recipe, other).ggml_type == "F16", (name, other)
    # An explicit type is what it says, whatever the source, and the recipe is the one it always was.
    explicit = get_recipe("tq2_0", {"embed_type": "F16", "output_type": "F16", "fallback_type": "F16"})
    assert decide("token_embd.weight", (1000, 640), explicit, "BF16").ggml_type == "F16"
    assert explicit == replace(RECIPES["tq2_0"], embed_type="F16", output_type="F16", fallback_type="F16")


def test_a_target_without_bf16_stores_f16() -> None:
    metal = get_recipe("q2_0", {"target": "metal"})
    assert metal == get_recipe("q2_0", {"embed_type": "F16", "output_type": "F16", "fallback_type": "F16"})
    assert decide("token_embd.weight", (1000, 640), metal, "BF16").ggml_type == "F16"
    for target in ("cpu", "cuda", "vulkan"):
        assert get_recipe("q2_0", {"target": target}).embed_type == SOURCE_16, target
    # What the user asked for stands: an explicit BF16 on Metal is kept (and warned about elsewhere).
    assert get_recipe("q2_0", {"target": "metal", "embed_type": "BF16"}).embed_type == "BF16"
    # The auto recipe's Q8_0 embedding and head are its own choice, not the source's type.
    assert get_recipe("auto", {"target": "metal"}).embed_type == "Q8_0"
