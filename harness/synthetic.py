"""Synthetic models with real tensor names and shapes, and deterministic contents.

Contents are a cheap hash of (tensor name, element index, version): any process can
produce the exact bytes any rank should hold at any version, for any rows of a tensor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import torch

Parallel = Literal["col", "row", "rep"]  # column-parallel (dim 0), row-parallel (dim 1), replicated


@dataclass(frozen=True)
class TensorDef:
    name: str
    shape: tuple[int, ...]
    parallel: Parallel

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def qwen3_dense(
    *,
    layers: int,
    hidden: int = 2048,
    heads: int = 16,
    kv_heads: int = 4,
    head_dim: int = 128,
    intermediate: int = 6144,
    vocab: int = 32768,
) -> list[TensorDef]:
    """Qwen3 dense, HF names: q/k/v/o, q_norm/k_norm, gate/up/down, norms, embeddings."""
    out = [TensorDef("model.embed_tokens.weight", (vocab, hidden), "col")]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            TensorDef(f"{p}.input_layernorm.weight", (hidden,), "rep"),
            TensorDef(f"{p}.self_attn.q_proj.weight", (heads * head_dim, hidden), "col"),
            TensorDef(f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden), "col"),
            TensorDef(f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden), "col"),
            TensorDef(f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim), "row"),
            TensorDef(f"{p}.self_attn.q_norm.weight", (head_dim,), "rep"),
            TensorDef(f"{p}.self_attn.k_norm.weight", (head_dim,), "rep"),
            TensorDef(f"{p}.post_attention_layernorm.weight", (hidden,), "rep"),
            TensorDef(f"{p}.mlp.gate_proj.weight", (intermediate, hidden), "col"),
            TensorDef(f"{p}.mlp.up_proj.weight", (intermediate, hidden), "col"),
            TensorDef(f"{p}.mlp.down_proj.weight", (hidden, intermediate), "row"),
        ]
    out += [
        TensorDef("model.norm.weight", (hidden,), "rep"),
        TensorDef("lm_head.weight", (vocab, hidden), "col"),
    ]
    return out


SMALL = {
    "hidden": 512,
    "heads": 8,
    "kv_heads": 2,
    "head_dim": 64,
    "intermediate": 1536,
    "vocab": 8192,
}


def qwen3_of_size(gigabytes: float, itemsize: int = 2) -> list[TensorDef]:
    """A Qwen3-shaped model of about `gigabytes` (decimal) of weights (narrower when small)."""
    dims = {} if gigabytes >= 0.5 else SMALL
    one = sum(t.numel for t in qwen3_dense(layers=1, **dims))
    fixed = sum(t.numel for t in qwen3_dense(layers=0, **dims))
    layers = max(1, round((gigabytes * 1e9 / itemsize - fixed) / (one - fixed)))
    return qwen3_dense(layers=layers, **dims)


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little") >> 1


_CHUNK = 1 << 25


def content(
    t: TensorDef, lo: int, hi: int, version: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Rows [lo, hi) of tensor `t` at `version`: a cheap hash of (name, element, version).

    Values are bf16 numbers of magnitude 1/128..1/64 with random signs, like weights;
    the same call gives the same bytes in any process.
    """
    row = t.numel // t.shape[0] if t.shape[0] else 0
    first, count = lo * row, (hi - lo) * row
    out = torch.empty(count, dtype=torch.int16)
    salt = (_seed(t.name) + version * 40503) & 0x7FFFFFFF
    for start in range(0, count, _CHUNK):
        n = min(_CHUNK, count - start)
        h = torch.arange(first + start, first + start + n, dtype=torch.int32)
        h.mul_(-1640531535).add_(salt).bitwise_right_shift_(9)
        out[start : start + n] = h.bitwise_and_(0x807F).bitwise_or_(0x3C00)
    x = out.view(torch.bfloat16).view((hi - lo, *t.shape[1:]))
    return x if dtype == torch.bfloat16 else x.to(dtype)


def changed(t: TensorDef, lo: int, hi: int, version: int, density: float) -> torch.Tensor:
    """Which elements of rows [lo, hi) of `t` a sparse step to `version` changes (about
    `density` of them): a hash of (name, element, version), the same in any process."""
    row = t.numel // t.shape[0] if t.shape[0] else 0
    first, count = lo * row, (hi - lo) * row
    salt = (_seed(t.name) * 31 + version * 7919) & 0x7FFFFFFF
    h = torch.arange(first, first + count, dtype=torch.int64)
    h.mul_(2654435761).add_(salt).bitwise_and_(0xFFFFFFFF).bitwise_right_shift_(12)
    return (h.remainder_(1 << 20) < int(density * (1 << 20))).view((hi - lo, *t.shape[1:]))


def step(
    t: TensorDef, lo: int, hi: int, current: torch.Tensor, version: int, density: float
) -> None:
    """A sparse training step, in place: the changed elements take their `version` values."""
    mask = changed(t, lo, hi, version, density)
    current[mask] = content(t, lo, hi, version)[mask]


def rows(n: int, index: int, count: int) -> tuple[int, int]:
    """torch.chunk's split of n rows: the index-th of count."""
    step = -(-n // count)
    start = min(n, index * step)
    return start, min(n, start + step)
