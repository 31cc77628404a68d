"""The benchmark's model: real HF names and shapes, deterministic random BF16 contents,
and the bytes every engine tensor must hold (by its recipe).

Contents: one table of random BF16 values (random sign, magnitudes 2^-9 up to 2^-1, random
mantissa) is built once per process from an integer hash, identically on every process
and device kind. Tensor `name` at `version` is the table read from an offset seeded by
(name, version), so any process produces any rows of any tensor with one or two copies.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weightwire.client.dtypes import TORCH
from weightwire.client.pack import Packer
from weightwire.plan.rules import EngineTensor, HfTensor
from weightwire.protocol.plan import PackOp
from weightwire.protocol.tensors import Box, Piece, piece_nbytes

ALIGN = 256  # bytes between tensors of one flat buffer
REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- config
def find_config(path: str) -> Path:
    """`path` as given, else relative to the repository (data/models/...)."""
    p = Path(path)
    if p.exists():
        return p
    q = REPO / path
    if q.exists():
        return q
    raise FileNotFoundError(f"model config {path} not found (nor {q})")


def load_config(path: str, layers: int | None = None, sets: Iterable[str] = ()) -> dict[str, Any]:
    """The HF config, with `num_hidden_layers` = `layers` and `KEY=VALUE` overrides (JSON
    values), e.g. to shrink the model for a CPU run."""
    cfg: dict[str, Any] = json.loads(find_config(path).read_text())
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set wants KEY=VALUE, got {item!r}")
        try:
            cfg[key] = json.loads(value)
        except json.JSONDecodeError:
            cfg[key] = value
    if layers is not None:
        cfg["num_hidden_layers"] = int(layers)
    return cfg


def numel(shape: Iterable[int]) -> int:
    return math.prod(shape)


def nbytes(t: HfTensor | EngineTensor) -> int:
    return numel(t.shape) * TORCH[t.dtype].itemsize


def shard_rows(n: int, index: int, count: int) -> tuple[int, int]:
    """torch.chunk's rows of the index-th of count (what client.Shard(0, ...) declares)."""
    step = -(-n // count)
    lo = min(n, index * step)
    return lo, min(n, lo + step)


# --------------------------------------------------------------------------- contents
class Content:
    """Deterministic random BF16 contents of any rows of any tensor, on `device`."""

    def __init__(self, device: torch.device, largest: int, max_log2: int = 26) -> None:
        bits = min(max_log2, max(16, (max(largest, 1) - 1).bit_length()))
        self.length = 1 << bits
        self.device = device
        table = torch.empty(self.length, dtype=torch.int16, device=device)
        chunk = 1 << 22
        m = 0xFFFFFFFF
        for start in range(0, self.length, chunk):
            n = min(chunk, self.length - start)
            i = torch.arange(start, start + n, dtype=torch.int64, device=device)
            h = (i * 0x9E3779B1 + 0x7F4A7C15) & m  # every product stays below 2^63
            h = (((h >> 16) ^ h) * 0x45D9F3B) & m
            h = (((h >> 16) ^ h) * 0x45D9F3B) & m
            h = (h >> 16) ^ h
            mant, exp, sign = h & 0x7F, 118 + ((h >> 7) & 7), (h >> 10) & 1
            table[start : start + n] = (mant + exp * 128 - sign * 32768).to(torch.int16)
        self.table = table  # int16 bit patterns of finite bf16 values

    def offset(self, name: str, version: int) -> int:
        digest = hashlib.blake2b(f"{name}@{version}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.length

    def fill(self, out: torch.Tensor, name: str, version: int, first: int = 0) -> None:
        """Write elements first.. of tensor `name` at `version` into bf16 tensor `out`
        (contiguous, on this device), in row-major order."""
        flat = out.reshape(-1).view(torch.int16)
        pos, n = 0, flat.numel()
        s = (self.offset(name, version) + first) % self.length
        while pos < n:
            k = min(n - pos, self.length - s)
            flat[pos : pos + k].copy_(self.table[s : s + k])
            pos += k
            s = 0

    def rows(self, t: HfTensor, lo: int, hi: int, version: int) -> torch.Tensor:
        """Rows [lo, hi) of HF tensor `t` at `version` (bf16; cast to t's dtype otherwise)."""
        row = numel(t.shape[1:])
        out = torch.empty((hi - lo, *t.shape[1:]), dtype=torch.bfloat16, device=self.device)
        self.fill(out, t.name, version, lo * row)
        dtype = TORCH[t.dtype]
        return out if dtype == torch.bfloat16 else out.to(dtype)


# --------------------------------------------------------------------------- layouts
def flat_views(
    specs: Iterable[tuple[str, str, tuple[int, ...]]], device: torch.device
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One allocation holding every (name, dtype, shape), 256-byte aligned; the views."""
    placed: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
    offset = 0
    for name, dtype, shape in specs:
        offset = -(-offset // ALIGN) * ALIGN
        dt = TORCH[dtype]
        placed.append((name, dt, shape, offset))
        offset += numel(shape) * dt.itemsize
    buf = torch.zeros(max(offset, 1), dtype=torch.uint8, device=device)
    views = {
        name: buf[off : off + numel(shape) * dt.itemsize].view(dt).view(shape)
        for name, dt, shape, off in placed
    }
    return buf, views


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def pack_piece(
    packer: Packer,
    piece: Piece,
    source: torch.Tensor,
    source_dtype: str,
    out: torch.Tensor,
    row0: int = 0,
) -> None:
    """Apply one recipe piece: `source` holds rows row0.. of the piece's HF tensor; its
    bytes land at the piece's offset of `out` (the engine tensor's bytes)."""
    box = piece.box
    if row0:
        box = Box(offsets=(box.offsets[0] - row0, *box.offsets[1:]), sizes=box.sizes)
    op = PackOp(
        source=piece.source,
        box=box,
        transform=piece.transform,
        staging_offset=piece.dst_offset,
        nbytes=piece_nbytes(source_dtype, piece),
    )
    packer.pack(op, source, out)


def expected(
    tensors: list[EngineTensor],
    hf: Mapping[str, HfTensor],
    content: Content,
    version: int,
    packer: Packer,
    scratch: list[torch.Tensor],
) -> list[torch.Tensor]:
    """The bytes engine tensors must hold at `version`, each built in its `scratch` from
    the regenerated HF rows its pieces read (Zeros pieces stay zero).

    Several tensors whose pieces read the same boxes in the same order (FP8 codes and
    their `_scale_inv`) are built in lockstep, so one quantization serves both.
    """
    outs = [buf[: nbytes(t)] for t, buf in zip(tensors, scratch, strict=True)]
    for out in outs:
        out.zero_()
    for pieces in zip(*(t.pieces for t in tensors), strict=True):
        first = pieces[0]
        if not first.sent:
            continue
        src = hf[first.source]
        lo = first.box.offsets[0]
        rows = content.rows(src, lo, lo + first.box.sizes[0], version)
        for piece, out in zip(pieces, outs, strict=True):
            pack_piece(packer, piece, rows, src.dtype, out, row0=lo)
    packer.clear()
    return outs


def lockstep(a: EngineTensor, b: EngineTensor | None) -> bool:
    """Whether b's pieces read exactly a's boxes, in order (an FP8 weight and its scales)."""
    return (
        b is not None
        and len(a.pieces) == len(b.pieces)
        and all(
            p.source == q.source and p.box == q.box and p.sent == q.sent
            for p, q in zip(a.pieces, b.pieces, strict=True)
        )
    )


# --------------------------------------------------------------------------- baseline
@dataclass(frozen=True)
class BaselineBucket:
    """HF tensors broadcast together; offsets of each in the flat broadcast buffer."""

    tensors: tuple[HfTensor, ...]
    offsets: tuple[int, ...]
    nbytes: int


def baseline_buckets(hf: Iterable[HfTensor], bucket_bytes: int) -> list[BaselineBucket]:
    """HF order, each bucket about `bucket_bytes` (a larger tensor goes alone)."""
    out: list[BaselineBucket] = []
    cur: list[HfTensor] = []
    offs: list[int] = []
    size = 0

    def close() -> None:
        nonlocal cur, offs, size
        if cur:
            out.append(BaselineBucket(tuple(cur), tuple(offs), size))
        cur, offs, size = [], [], 0

    for t in hf:
        n = nbytes(t)
        if cur and size + n > bucket_bytes:
            close()
        size = -(-size // ALIGN) * ALIGN
        cur.append(t)
        offs.append(size)
        size += n
    close()
    return out


# --------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Sizes:
    """Bytes of one model configuration (for memory checks and the report)."""

    hf_bytes: int
    hf_tensors: int
    largest_hf: int
    engine_bytes: list[int]  # per engine rank
    largest_engine: int
    layers: int


def sizes(cfg: Mapping[str, Any], engines: int, dest: str) -> Sizes:
    from weightwire.plan.rules import engine_tensors, hf_tensors
    from weightwire.protocol.local import EngineLayout

    hf = hf_tensors(cfg)
    per_engine, largest = [], 0
    for e in range(engines):
        lay = EngineLayout(tp_size=engines, tp_rank=e, model=dict(cfg), dest_dtype=dest_dtype(dest))
        ets = engine_tensors(cfg, lay)
        per_engine.append(sum(nbytes(t) for t in ets))
        largest = max([largest, *(nbytes(t) for t in ets)])
    return Sizes(
        hf_bytes=sum(nbytes(t) for t in hf),
        hf_tensors=len(hf),
        largest_hf=max(nbytes(t) for t in hf),
        engine_bytes=per_engine,
        largest_engine=largest,
        layers=int(cfg["num_hidden_layers"]),
    )


def dest_dtype(dest: str) -> str:
    """--dest to EngineLayout.dest_dtype: bf16 = as the (BF16) config says, fp8 = FP8 blocks."""
    return "fp8" if dest == "fp8" else ""


GiB = 1 << 30
RANK_OVERHEAD = int(2.5 * GiB)  # CUDA context, NCCL, allocator slack, content table


def peak_bytes(
    s: Sizes, trainers: int, engines: int, full_trainers: bool, bucket_bytes: int, baseline: bool
) -> tuple[int, int]:
    """(trainer, engine) peak GPU bytes, estimated: weights, staging (the trainer's share
    of every engine's bytes), the baseline's buffers, verification scratch."""
    shard = s.hf_bytes if full_trainers else -(-s.hf_bytes // trainers)
    staging = -(-sum(s.engine_bytes) // trainers)
    bucket = max(bucket_bytes, s.largest_hf)
    base_t = (bucket // trainers + bucket + bucket) if baseline else 0
    trainer = shard + staging + base_t + s.largest_hf + RANK_OVERHEAD
    engine = (
        max(s.engine_bytes)
        + (bucket if baseline else 0)
        + s.largest_engine
        + 3 * s.largest_hf
        + RANK_OVERHEAD
    )
    return trainer, engine
