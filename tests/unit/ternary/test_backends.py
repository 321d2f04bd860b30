"""The backend table: the default recipe per target, and a warning for each type a target runs badly."""

from __future__ import annotations

import pytest

from pipeline.ternary.backends import Support, backend_warnings, default_recipe, support


def test_defaults_follow_the_kernels() -> None:
    assert default_recipe("cpu") == "tq2_0"
    assert [default_recipe(t) for t in ("cuda", "metal", "vulkan")] == ["q2_0"] * 3


def test_cuda_has_no_tq_kernel_and_x86_runs_q2_0_scalar() -> None:
    assert support("TQ2_0", "cuda") is Support.NONE and support("tq1_0", "cuda") is Support.NONE
    assert support("Q2_0", "cpu") is Support.SCALAR and support("Q1_0", "cpu") is Support.FAST
    assert support("Q4_K", "cuda") is Support.FAST  # outside the table: runs everywhere


def test_warnings_name_the_type_the_target_and_the_better_recipe() -> None:
    (warning,) = backend_warnings(["TQ2_0", "F32", "Q4_K"], "cuda")
    assert warning.startswith("TQ2_0 has no kernel on cuda") and "'q2_0'" in warning
    (warning,) = backend_warnings(["Q2_0"], "cpu")
    assert "scalar" in warning and "NEON" in warning and "'tq2_0'" in warning
    assert backend_warnings(["Q2_0", "F16"], "cuda") == []


def test_unknown_target_is_refused() -> None:
    with pytest.raises(ValueError, match="expected one of cpu, cuda, metal, vulkan"):
        default_recipe("tpu")
