"""The gptq fit packed into every ternary block type: the bytes decode to what it reports, and the
layer's output error beats the plain optimal fit's on correlated inputs."""

from __future__ import annotations

import pytest
import torch

from pipeline.ternary.codecs import decompose_packed
from pipeline.ternary.decompose_gptq import decompose_gptq_packed
from pipeline.ternary.gptq import output_sq_error
from pipeline.ternary.pack import decode_bytes


def _layer(seed: int = 0, rows: int = 16, cols: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen)
    # Correlated inputs with uneven scales: where error compensation pays.
    mix = torch.randn(cols, cols, generator=gen) / cols**0.5 + torch.eye(cols)
    x = torch.randn(1024, cols, generator=gen) @ mix * torch.linspace(0.2, 3.0, cols)
    return weight, (x.T @ x).double()


_TYPES = [("TQ2_0", 3), ("TQ1_0", 3), ("Q2_0", 3), ("Q2_0", 4), ("Q1_0", 3)]


@pytest.mark.parametrize("ggml_type, levels", _TYPES)
def test_packed_gptq_decodes_and_beats_the_plain_fit(ggml_type: str, levels: int) -> None:
    weight, gram = _layer()
    packed = decompose_gptq_packed(weight, ggml_type, gram, levels)
    values = torch.from_numpy(decode_bytes(packed.raw, ggml_type, tuple(weight.shape)))
    rel = float(torch.linalg.vector_norm(weight - values) / torch.linalg.vector_norm(weight))
    assert rel == pytest.approx(packed.rel_error, rel=1e-4) and packed.method == "gptq"
    assert packed.n_zero == int((values == 0).sum()) and packed.absmean_rel_error > 0
    plain = decompose_packed(weight, ggml_type, "optimal", levels=levels)
    plain_values = torch.from_numpy(decode_bytes(plain.raw, ggml_type, tuple(weight.shape)))
    assert output_sq_error(weight, values, gram) < output_sq_error(weight, plain_values, gram)


def test_a_type_without_the_fit_is_refused() -> None:
    weight, gram = _layer(cols=256)
    with pytest.raises(ValueError, match="no error-compensating fit"):
        decompose_gptq_packed(weight, "Q8_0", gram)
