"""What every family's rules share: reading the config and the layout, and turning
"these boxes of HF tensors, concatenated" into an engine tensor with its pieces.

An engine *matrix* is a stack of slots (one slot for a linear layer's weight, one per
local expert for `w13_weight`/`w2_weight`); each slot is segments concatenated on dim 0,
every segment a 2-D box of one HF tensor. A bf16 matrix is those boxes' bytes in order;
an FP8 matrix is two tensors, the codes (`Fp8BlockQuant` of each segment) and the float32
block scales `<name>_scale_inv` (`Fp8BlockScale` of each segment), as SGLang holds an FP8
block checkpoint's `weight` and `weight_scale_inv` after its loaders sliced them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.local import EngineLayout
from weightwire.protocol.tensors import (
    ITEMSIZE,
    Box,
    Cast,
    Fp8BlockQuant,
    Fp8BlockScale,
    Piece,
    Transform,
    Zeros,
)

from . import EngineTensor, HfTensor

FP8 = "float8_e4m3fn"
SCALE = "float32"
FLOAT_DTYPES = ("bfloat16", "float16", "float32")

# architectures[0] (or model_type) -> family
_ARCH = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
_MODEL_TYPE = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
}
# spellings accepted in EngineLayout.family
_ALIASES = {
    **_MODEL_TYPE,
    "qwen3-moe": "qwen3_moe",
    "qwen3moe": "qwen3_moe",
    "deepseek-v3": "deepseek_v3",
    "deepseekv3": "deepseek_v3",
    "kimi-k2": "deepseek_v3",
    "kimi": "deepseek_v3",
}
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")


def family_of(config: Mapping[str, Any], hint: str = "") -> str:
    """The rules family of an HF config (`architectures`, else `model_type`).

    `hint` (EngineLayout.family) is used when the config names neither, and must agree
    with the config when it does.
    """
    found = ""
    for arch in config.get("architectures") or ():
        if arch in _ARCH:
            found = _ARCH[arch]
            break
    if not found:
        found = _MODEL_TYPE.get(str(config.get("model_type", "")), "")
    want = _ALIASES.get(hint.lower(), hint.lower()) if hint else ""
    if want and want not in FAMILIES:
        raise PlanError(f"unknown model family {hint!r} (known: {', '.join(FAMILIES)})")
    if found and want and found != want:
        raise PlanError(f"layout says family {hint!r}, but the model config is {found!r}")
    family = found or want
    if not family:
        raise PlanError(
            "no rules for this model: architectures="
            f"{config.get('architectures')!r}, model_type={config.get('model_type')!r} "
            f"(known: {', '.join(sorted(_ARCH))}; model_type kimi_k2)"
        )
    return family


def checkpoint_dtype(config: Mapping[str, Any]) -> str:
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    dtype = dtype.removeprefix("torch.")
    if dtype not in FLOAT_DTYPES:
        raise PlanError(f"checkpoint dtype {dtype!r} is not one of {', '.join(FLOAT_DTYPES)}")
    return dtype


def fp8_block(config: Mapping[str, Any]) -> int | None:
    """The block size of an FP8 block-quantized config, or None when it is not one."""
    q = config.get("quantization_config")
    if not isinstance(q, Mapping) or q.get("quant_method") != "fp8":
        return None
    size = q.get("weight_block_size")
    if not size:
        raise PlanError("FP8 config without weight_block_size: only block FP8 is supported")
    if len(size) != 2 or size[0] != size[1]:
        raise PlanError(f"FP8 weight_block_size {size} is not square: not supported")
    return int(size[0])


def optional(config: Mapping[str, Any], key: str, default: int) -> int:
    """A size the rules can do without (`default` when absent or null); when given, a
    positive integer, as `need`."""
    return default if config.get(key) is None else need(config, key)


def need(config: Mapping[str, Any], key: str) -> int:
    """A size or count the rules need: a positive integer (a negative layer count planned
    no layers, a list or a string failed with a bare TypeError)."""
    value = config.get(key)
    if value is None:
        raise PlanError(f"model config has no {key!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"model config {key!r} is {value!r}: it must be a positive integer")
    return value


def split(n: int, parts: int, index: int, what: str) -> tuple[int, int]:
    """[lo, hi) of the index-th of `parts` equal parts of n (PlanError when uneven)."""
    if n % parts:
        raise PlanError(f"{what} ({n}) is not divisible by {parts}")
    per = n // parts
    return index * per, (index + 1) * per


@dataclass(frozen=True)
class Seg:
    """A 2-D box of one HF tensor (rows lo:hi, cols lo:hi)."""

    source: str
    box: Box


@dataclass
class Ctx:
    """One engine rank of one model: config, parallelism, dtypes; collects the tensors."""

    cfg: Mapping[str, Any]
    family: str
    tp: int
    rank: int
    ep: int
    hf: dict[str, HfTensor]
    dtype: str  # engine dtype of every tensor that is neither FP8 nor an fp32 exception
    block: int | None  # FP8 block size when the quantized linears are FP8, else None
    out: list[EngineTensor] = field(default_factory=list)

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp

    @property
    def moe_ep_rank(self) -> int:
        return self.rank // self.moe_tp

    # ---------------------------------------------------------------- boxes
    def shape(self, source: str) -> tuple[int, ...]:
        return self.hf[source].shape

    def full(self, source: str) -> Seg:
        return Seg(source, Box.full(self.shape(source)))

    def rows(self, source: str, lo: int, hi: int) -> Seg:
        return Seg(source, Box.rows(self.shape(source), lo, hi, dim=0))

    def cols(self, source: str, lo: int, hi: int) -> Seg:
        return Seg(source, Box.rows(self.shape(source), lo, hi, dim=1))

    def transform(self, source: str, dtype: str) -> Transform:
        """Always a Cast to the engine dtype: a trainer may hold any float dtype (FSDP keeps
        float32 masters), and a Cast to the same dtype is a plain copy."""
        del source
        return Cast(dtype=dtype)  # type: ignore[arg-type]

    # ---------------------------------------------------------------- emitters
    def whole(self, name: str, source: str, dtype: str | None = None) -> None:
        """A replicated tensor: the whole HF tensor (norms, router gates, biases)."""
        self.vector(name, [self.full(source)], dtype)

    def vector(self, name: str, segs: Sequence[Seg], dtype: str | None = None) -> None:
        """Boxes concatenated on dim 0, never quantized (norms, fused biases, replicated)."""
        dtype = dtype or self.dtype
        pieces, offset, rows = [], 0, 0
        rest: tuple[int, ...] | None = None
        for s in segs:
            pieces.append(
                Piece(
                    source=s.source,
                    box=s.box,
                    dst_offset=offset,
                    transform=self.transform(s.source, dtype),
                )
            )
            offset += s.box.numel * ITEMSIZE[dtype]
            rows += s.box.sizes[0]
            rest = tuple(s.box.sizes[1:])
        self.add(name, dtype, (rows, *(rest or ())), pieces)

    def linear(self, name: str, segs: Sequence[Seg], quantized: bool = True) -> None:
        """A linear layer's weight: segments on dim 0 (FP8 codes + scales when quantized)."""
        self.matrix(name, [segs], stacked=False, quantized=quantized)

    def matrix(
        self, name: str, slots: Sequence[Sequence[Seg]], stacked: bool, quantized: bool = True
    ) -> None:
        cols = {s.box.sizes[1] for slot in slots for s in slot}
        rows = {sum(s.box.sizes[0] for s in slot) for slot in slots}
        if len(cols) != 1 or len(rows) != 1:
            raise AssertionError(f"{name}: ragged segments {rows} x {cols}")
        (ncols,), (nrows,) = cols, rows
        lead = (len(slots),) if stacked else ()
        if self.block is None or not quantized:
            item = ITEMSIZE[self.dtype]
            pieces = []
            offset = 0
            for slot in slots:
                for s in slot:
                    t = self.transform(s.source, self.dtype)
                    pieces.append(Piece(source=s.source, box=s.box, dst_offset=offset, transform=t))
                    offset += s.box.numel * item
            self.add(name, self.dtype, (*lead, nrows, ncols), pieces)
            return
        b = self.block
        tcols = -(-ncols // b)
        codes, scales = [], []
        c_off = s_off = 0
        trows = 0
        for slot in slots:
            trows = 0
            for s in slot:
                self._check_tiles(name, s)
                codes.append(
                    Piece(source=s.source, box=s.box, dst_offset=c_off, transform=Fp8BlockQuant(b))
                )
                scales.append(
                    Piece(source=s.source, box=s.box, dst_offset=s_off, transform=Fp8BlockScale(b))
                )
                tr = -(-s.box.sizes[0] // b)
                c_off += s.box.numel
                s_off += tr * tcols * 4
                trows += tr
        self.add(name, FP8, (*lead, nrows, ncols), codes)
        self.add(name + "_scale_inv", SCALE, (*lead, trows, tcols), scales)

    def vocab(self, name: str, source: str) -> None:
        """A vocab-parallel embedding or lm_head: this rank's rows of the padded vocabulary,
        the padding rows zero (VocabParallelEmbedding, padding 64, or 64*tp when the padded
        size does not divide by tp)."""
        vocab, hidden = self.shape(source)
        pad = 64
        if (-(-vocab // pad) * pad) % self.tp:
            pad *= self.tp
        per = (-(-vocab // pad) * pad) // self.tp
        lo, hi = self.rank * per, min((self.rank + 1) * per, vocab)
        pieces = []
        item = ITEMSIZE[self.dtype]
        if hi > lo:
            t = self.transform(source, self.dtype)
            box = Box.rows((vocab, hidden), lo, hi)
            pieces.append(Piece(source=source, box=box, dst_offset=0, transform=t))
        held = max(hi - lo, 0)
        if held < per:
            zero = Box(offsets=(0, 0), sizes=(per - held, hidden))
            z = Zeros(dtype=self.dtype)  # type: ignore[arg-type]
            pieces.append(Piece(source="", box=zero, dst_offset=held * hidden * item, transform=z))
        self.add(name, self.dtype, (per, hidden), pieces)

    def add(self, name: str, dtype: str, shape: tuple[int, ...], pieces: Sequence[Piece]) -> None:
        self.out.append(EngineTensor(name=name, dtype=dtype, shape=shape, pieces=tuple(pieces)))

    def _check_tiles(self, name: str, s: Seg) -> None:
        """An FP8 segment must be whole tiles of its HF tensor (a partial tile only at the
        tensor's end): the engine's scales are the checkpoint's block scales, sliced."""
        b = self.block
        assert b is not None
        shape = self.shape(s.source)
        for d in (0, 1):
            lo, n = s.box.offsets[d], s.box.sizes[d]
            if lo % b or (n % b and lo + n != shape[d]):
                raise PlanError(
                    f"{name}: FP8 {b}x{b} blocks need this rank's slice of {s.source} "
                    f"{list(shape)} to be whole blocks, but it is {lo}:{lo + n} on dim {d} "
                    f"(tp={self.tp}, ep={self.ep})",
                    code=ErrorCode.SHAPE_MISMATCH,
                )


def make_ctx(config: Mapping[str, Any], layout: EngineLayout, hf: Sequence[HfTensor]) -> Ctx:
    family = family_of(config, layout.family)
    tp, rank, ep = layout.tp_size, layout.tp_rank, layout.ep_size
    if tp < 1 or not 0 <= rank < tp:
        raise PlanError(f"engine layout: tp_rank {rank} outside tp_size {tp}")
    if ep < 1 or tp % ep:
        raise PlanError(f"engine layout: ep_size {ep} must divide tp_size {tp} (moe_tp = tp/ep)")
    if ep > 1 and layout.ep_rank != rank // (tp // ep):
        raise PlanError(
            f"engine layout: tp_rank {rank} of tp {tp} is SGLang's EP rank {rank // (tp // ep)} "
            f"(tp_rank // (tp/ep)), but the layout says ep_rank {layout.ep_rank}"
        )
    base = checkpoint_dtype(config)
    dest = layout.dest_dtype.removeprefix("torch.")
    block: int | None
    if dest == "":
        dtype, block = base, fp8_block(config)
    elif dest == "fp8":
        dtype, block = base, fp8_block(config) or 128
    elif dest in FLOAT_DTYPES:
        dtype, block = dest, None
    else:
        raise PlanError(
            f"engine layout: dest_dtype {layout.dest_dtype!r} is not one of "
            f"'', 'fp8', {', '.join(map(repr, FLOAT_DTYPES))}"
        )
    return Ctx(
        cfg=config,
        family=family,
        tp=tp,
        rank=rank,
        ep=ep,
        hf=_by_name(hf),
        dtype=dtype,
        block=block,
    )


_BY_NAME: dict[int, tuple[Sequence[HfTensor], dict[str, HfTensor]]] = {}


def _by_name(hf: Sequence[HfTensor]) -> dict[str, HfTensor]:
    """A model's HF tensors by name, made once per tensor list (every engine rank of a
    model resolves from the same one); the dict is only read."""
    hit = _BY_NAME.get(id(hf))
    if hit is None or hit[0] is not hf:
        if len(_BY_NAME) >= 8:
            _BY_NAME.clear()
        hit = _BY_NAME[id(hf)] = (hf, {t.name: t for t in hf})
    return hit[1]


def hf_builder(config: Mapping[str, Any], dtype: str) -> tuple[list[HfTensor], Any]:
    """(list, add(name, *shape)) to collect HF tensors in checkpoint order."""
    out: list[HfTensor] = []

    def add(name: str, *shape: int, dt: str | None = None) -> None:
        out.append(HfTensor(name=name, dtype=dt or dtype, shape=tuple(shape)))

    return out, add


def head_dim(config: Mapping[str, Any]) -> int:
    if config.get("head_dim") is not None:
        return need(config, "head_dim")
    return need(config, "hidden_size") // need(config, "num_attention_heads")
