"""A plain-torch forward of the HF architectures Bonsai packages, in llama.cpp's tensor layout.

Weights come from the checkpoint by GGUF name (`CheckpointTensors`), already as the packager
writes them: q/k rows permuted for GGML's adjacent-pair rope where the architecture needs it,
BitNet's latent weights rounded to the ternary values the model computes with. So the forward
is llama.cpp's graph for these architectures (llm_build_llama, qwen2, qwen3, bitnet): RMS
norms, rope (adjacent pairs for llama/mistral, NEOX half-split for qwen2/qwen3/bitnet; Llama
3.1 frequency factors and linear scaling), grouped-query causal attention, optional q/k/v
biases, Qwen3's per-head q/k norms, BitNet's sub-norms, a SiLU-gated feed-forward. Each
linear weight's input is handed to ``on_input`` as it is computed: what calibration records.

`block_forward` runs one transformer block over one sequence; a caller that loops blocks on
the outside and sequences on the inside holds one block's weights at a time.

Example::

    spec = model_spec(card)
    with CheckpointTensors(card, files, device) as ckpt:
        x = ckpt.get("token_embd.weight")[torch.tensor(ids)]
        for i in range(spec.n_layers):
            x = block_forward(spec, ckpt.block(i), x, prefix=f"blk.{i}.")
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from pipeline.core.errors import InputError
from pipeline.formats.model_card import ModelCard

__all__ = ["ModelSpec", "model_spec", "CheckpointTensors", "LazyBlock", "block_forward", "blocks_forward",
           "rms_norm", "head_logits"]

# Elements of a 16-bit weight widened to float32 at once for a product (16 MB).
_WIDEN_ELEMENTS = 4 << 20
# GGUF architectures whose llama.cpp graph uses NEOX (half-split) rope on unpermuted rows.
_NEOX = frozenset({"qwen2", "qwen3", "bitnet"})
_ROPE_KINDS = frozenset({"default", "linear", "llama3"})
OnInput = Callable[[Sequence[str], torch.Tensor], None]


@dataclass(frozen=True)
class ModelSpec:
    """The hyperparameters the forward needs, from config.json; ``freq_factors`` divide rope frequencies."""

    arch: str
    n_layers: int
    hidden: int
    n_head: int
    n_kv: int
    head_dim: int
    eps: float
    rope_theta: float
    is_neox: bool
    freq_scale: float = 1.0
    freq_factors: tuple[float, ...] | None = None
    # What llama.cpp's CPU matmul rounds a weight's input to: the weight's own 16-bit type (its
    # dot products run in it), None for float32 weights. The inputs recorded for statistics are not.
    matmul_dtype: torch.dtype | None = None


def model_spec(card: ModelCard) -> ModelSpec:
    """The forward's hyperparameters for the card's architecture.

    Raises InputError for an architecture Bonsai does not package, a rope scaling it does not
    compute (yarn, longrope, dynamic), or missing/invalid config keys.
    """
    from pipeline.formats.gguf.writer import llama3_rope_factors
    from pipeline.formats.hf.checkpoint import arch_spec

    spec = arch_spec(card)
    config = dict(card.config)
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = str(scaling.get("rope_type") or scaling.get("type") or "default")
    if kind not in _ROPE_KINDS:
        raise InputError(
            f"config.json rope scaling {kind!r}: the torch forward computes {sorted(_ROPE_KINDS)} only"
        )
    try:
        n_head = int(config["num_attention_heads"])
        theta = float(config.get("rope_theta") or scaling.get("rope_theta") or 10000.0)
        factors = llama3_rope_factors(config)
        hidden, n_layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"config.json lacks a usable hyperparameter for the torch forward: {exc!r}") from exc
    return ModelSpec(
        arch=spec.gguf_name,
        n_layers=n_layers,
        hidden=hidden,
        n_head=n_head,
        n_kv=int(config.get("num_key_value_heads") or n_head),
        head_dim=int(config.get("head_dim") or hidden // n_head),
        eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        is_neox=spec.gguf_name in _NEOX,
        freq_scale=1.0 / float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0,
        freq_factors=None if factors is None else tuple(float(f) for f in factors),
        matmul_dtype=_matmul_dtype(card),
    )


def _matmul_dtype(card: ModelCard) -> torch.dtype | None:
    """The 16-bit type of the checkpoint's block weights (as the source GGUF keeps them), if any."""
    stored = {t.dtype for t in card.tensors if len(t.shape) == 2 and ".layers." in t.name}
    return {frozenset({"BF16"}): torch.bfloat16, frozenset({"F16"}): torch.float16}.get(frozenset(stored))


class CheckpointTensors:
    """Random access to an HF checkpoint's planned tensors by GGUF name, in the packager's layout.

    Applies the same per-tensor rules as `gguf_pack.source.iter_tensors` (rope row permutation,
    BitNet weight rounding), reading one tensor at a time; a test checks both agree. Each
    returned tensor is float32, on ``device``, in memory of its own. Use as a context manager.
    """

    def __init__(
        self, card: ModelCard, files: Mapping[str, Path], device: str | torch.device = "cpu"
    ) -> None:
        from pipeline.formats.hf.checkpoint import arch_spec, tensor_plan

        self.card, self.files, self.device = card, files, torch.device(device)
        self.spec = arch_spec(card)
        self.plan = {p.gguf_name: p for p in tensor_plan(card)}
        self._readers: dict[str, Any] = {}

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for reader in self._readers.values():
            reader.__exit__(None, None, None)
        self._readers.clear()

    def has(self, name: str) -> bool:
        """Whether the checkpoint plan has GGUF tensor ``name``."""
        return name in self.plan

    def _reader(self, shard: str) -> Any:
        from pipeline.formats.rawio import SafetensorsReader

        if shard not in self._readers:
            path = self.files.get(shard)
            if path is None or not Path(path).is_file():
                raise InputError(f"shard {shard!r} is not among the input files ({sorted(self.files)})")
            self._readers[shard] = SafetensorsReader(Path(path)).__enter__()
        return self._readers[shard]

    def get(self, name: str, as_stored: bool = False) -> torch.Tensor:
        """GGUF tensor ``name`` (KeyError when the plan lacks it), as float32; ``as_stored``: a 2-D
        BF16 or F16 weight stays in that type (half the memory; `block_forward` widens one at a time)."""
        from pipeline.formats.hf.architectures import ROPE_PERMUTED, TERNARY_LATENT_KINDS
        from pipeline.formats.hf.checkpoint import bitnet_weight_quant, rope_permute

        item = self.plan[name]
        config = self.card.config
        rows = None
        for suffix, head_key in ROPE_PERMUTED.items():
            if self.spec.has_rope_permute and item.hf_name.endswith(suffix):
                n_head = int(config.get(head_key) or config["num_attention_heads"])
                rows = rope_permute(torch.arange(item.shape[0]), n_head)
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        is_latent = self.spec.ternary_latent and kind in TERNARY_LATENT_KINDS and name.endswith(".weight")
        keep = as_stored and len(item.shape) == 2 and not is_latent
        tensor = self._reader(item.shard).tensor(item.hf_name, row_order=rows, as_stored=keep)
        if is_latent:
            tensor = bitnet_weight_quant(tensor)
        dtype = tensor.dtype if keep and tensor.dtype in (torch.bfloat16, torch.float16) else torch.float32
        if keep and dtype == tensor.dtype and self.device.type == "cpu":
            mapped: torch.Tensor = tensor  # the reader's mapping of the file (valid while held): no copy
            return mapped
        out: torch.Tensor = tensor.to(self.device, dtype, copy=True)
        return out

    def lazy_block(self, index: int) -> LazyBlock:
        """Block ``index``'s tensors, each read (in its stored 16-bit type) only when asked for."""
        return LazyBlock(self, f"blk.{index}.")

    def block(self, index: int, as_stored: bool = False) -> dict[str, torch.Tensor]:
        """Every tensor of block ``index``, keyed without its ``blk.<index>.`` prefix (see `get`)."""
        prefix = f"blk.{index}."
        return {n[len(prefix) :]: self.get(n, as_stored) for n in self.plan if n.startswith(prefix)}


class LazyBlock(Mapping[str, torch.Tensor]):
    """One block's tensors by name without the ``blk.<i>.`` prefix; each read from the checkpoint when
    asked for and not kept, so a caller that asks for each once holds one tensor at a time."""

    def __init__(self, ckpt: CheckpointTensors, prefix: str) -> None:
        self._ckpt, self._prefix = ckpt, prefix
        self._names = [n[len(prefix) :] for n in ckpt.plan if n.startswith(prefix)]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._ckpt.get(self._prefix + name, as_stored=True)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Rotate ``x`` [n, heads, head_dim] by position, as llama.cpp's rope for this architecture."""
    n, d = x.shape[0], spec.head_dim
    exponent = torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d
    freqs = spec.rope_theta**-exponent
    if spec.freq_factors is not None:
        freqs = freqs / torch.tensor(spec.freq_factors, dtype=torch.float64, device=x.device)
    angles = torch.outer(torch.arange(n, dtype=torch.float64, device=x.device) * spec.freq_scale, freqs)
    cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
    if spec.is_neox:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def _rounded(spec: ModelSpec, x: torch.Tensor) -> torch.Tensor:
    return x if spec.matmul_dtype is None else x.to(spec.matmul_dtype).float()


def _product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in float32; a 16-bit weight is widened a slice of rows at a time, for this
    product only."""
    if weight.dtype == torch.float32:
        return x @ weight.T
    rows, cols = weight.shape
    step = max(1, _WIDEN_ELEMENTS // cols)
    # One widening buffer and the output allocated up front: slices allocated and freed in turn
    # leave the allocator's heap holding their high-water mark long after the product.
    wide = torch.empty((min(step, rows), cols), dtype=torch.float32, device=x.device)
    out = torch.empty((rows, x.shape[0]), dtype=torch.float32, device=x.device)
    for i in range(0, rows, step):
        n = min(step, rows - i)
        wide[:n].copy_(weight[i : i + n])
        torch.matmul(wide[:n], x.T, out=out[i : i + n])
    return out.T


def _linear(spec: ModelSpec, w: Mapping[str, torch.Tensor], kind: str, x: torch.Tensor) -> torch.Tensor:
    out = _product(_rounded(spec, x), w[f"{kind}.weight"])
    bias = w.get(f"{kind}.bias")
    return out + bias if bias is not None else out


def _attention(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention: q [n, H, d], k/v [n, KV, d] -> [n, H * d]."""
    n = q.shape[0]
    group = spec.n_head // spec.n_kv
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(spec.head_dim)
    mask = torch.full((n, n), float("-inf"), device=q.device).triu(1)
    att = torch.softmax(scores + mask, dim=-1)
    return torch.einsum("hqk,khd->qhd", att, v).reshape(n, -1)


def block_forward(
    spec: ModelSpec,
    w: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    *,
    prefix: str = "",
    on_input: OnInput | None = None,
) -> torch.Tensor:
    """One transformer block over one sequence: ``x`` [n_tokens, hidden] -> the block's output.

    ``w``: the block's tensors without their ``blk.<i>.`` prefix (`CheckpointTensors.block`).
    ``on_input(names, rows)`` receives each linear weight's input rows (``prefix`` + name).
    """
    return blocks_forward(spec, w, [x], prefix=prefix, on_input=on_input)[0]


def blocks_forward(
    spec: ModelSpec,
    w: Mapping[str, torch.Tensor],
    xs: Sequence[torch.Tensor],
    *,
    prefix: str = "",
    on_input: OnInput | None = None,
    counted: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """One transformer block over several sequences at once: each weight is read once, for the rows
    of all of them (attention stays within each sequence, positions from 0 in each), so ``w`` may
    load each tensor as it is asked for (`CheckpointTensors.lazy_block`). ``on_input`` receives the
    rows of the ``counted`` sequences only (all when None)."""
    lengths = [int(x.shape[0]) for x in xs]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    x = torch.cat(list(xs))
    n = x.shape[0]
    keep = None if counted is None else torch.cat([
        torch.full((length,), bool(c), dtype=torch.bool, device=x.device)
        for length, c in zip(lengths, counted, strict=True)])

    def seen(names: Sequence[str], rows: torch.Tensor) -> None:
        if on_input is not None and (keep is None or bool(keep.any())):
            on_input([prefix + name for name in names], rows if keep is None else rows[keep])

    h = rms_norm(x, w["attn_norm.weight"], spec.eps)
    seen(["attn_q.weight", "attn_k.weight", "attn_v.weight"], h)
    q = _linear(spec, w, "attn_q", h).view(n, spec.n_head, spec.head_dim)
    k = _linear(spec, w, "attn_k", h).view(n, spec.n_kv, spec.head_dim)
    v = _linear(spec, w, "attn_v", h).view(n, spec.n_kv, spec.head_dim)
    if "attn_q_norm.weight" in w:
        q = rms_norm(q, w["attn_q_norm.weight"], spec.eps)
        k = rms_norm(k, w["attn_k_norm.weight"], spec.eps)
    out = torch.cat([
        _attention(spec, _rope(q[a : a + m], spec), _rope(k[a : a + m], spec), v[a : a + m])
        for a, m in zip(starts, lengths, strict=True)
    ])
    if "attn_sub_norm.weight" in w:
        out = rms_norm(out, w["attn_sub_norm.weight"], spec.eps)
    seen(["attn_output.weight"], out)
    x = x + _linear(spec, w, "attn_output", out)
    h = rms_norm(x, w["ffn_norm.weight"], spec.eps)
    seen(["ffn_gate.weight", "ffn_up.weight"], h)
    act = torch.nn.functional.silu(_linear(spec, w, "ffn_gate", h)) * _linear(spec, w, "ffn_up", h)
    if "ffn_sub_norm.weight" in w:
        act = rms_norm(act, w["ffn_sub_norm.weight"], spec.eps)
    seen(["ffn_down.weight"], act)
    x = x + _linear(spec, w, "ffn_down", act)
    return list(torch.split(x, lengths))


def head_logits(spec: ModelSpec, norm: torch.Tensor, head: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Logits [n_tokens, n_vocab] from the last block's output: output norm, then the output head."""
    return _product(_rounded(spec, rms_norm(x, norm, spec.eps)), head)
