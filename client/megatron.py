"""A Megatron-core GPTModel's parameters as this rank holds them, as boxes of HF tensors:
the source-side mirror of the engines' recipes (`plan/rules`), so each engine tensor is
filled from the Megatron shards that hold it, with no TP/EP/PP gather on the trainer.

Every Megatron layout is a set of boxes of HF tensors at known places of the local tensor:

- `linear_qkv` (column-parallel, interleaved per query group g: the q heads of g, then
  k_g, then v_g; a TP rank holds groups [g0, g1)): q_proj rows of heads [g0*hpg, g1*hpg),
  k_proj and v_proj rows of groups [g0, g1). Each is one box of the HF tensor, held as a
  view that steps over the groups (shape (groups, rows per group, ...): `MERGED_ROWS`);
  with one group per rank the view is a plain row range. Bias (Qwen2) the same way.
- `linear_fc1` = [gate; up], each TP (expert TP for experts) rank holding its rows of
  both: gate_proj rows = the first half of the local tensor, up_proj rows = the second.
- Column- and row-parallel linears: the box is the rank's chunk of the one dimension the
  local tensor is smaller on; replicated parameters (norms, router) are whole.
- Experts: `mlp.experts.local_experts.N` (SequentialMLP) or `mlp.experts.linear_fcK.weightN`
  (TEGroupedMLP) are expert `ep_rank * local_count + N`; expert TP cuts them as above.
- Pipeline stages: `decoder.layers.N` is HF layer `layer_number - 1` of that layer module
  (Megatron numbers layers globally, from 1, whatever the stage or virtual chunk).
- Vocabulary padded to a multiple of `make_vocab_size_divisible_by x TP`: a rank holds
  rows [r*n, (r+1)*n) of the padded table; only the rows below the HF vocabulary size are
  registered (pad rows are never sent).
- Output layer: `lm_head.weight` unless the HF config ties it to the embedding (then the
  last stage's copy, `output_layer.weight`, is left out).
- MLA (DeepSeek-V3 / Kimi-K2): `linear_q_down_proj` -> q_a_proj, `linear_q_up_proj` ->
  q_b_proj (or `linear_q_proj` -> q_proj), `linear_kv_down_proj` -> kv_a_proj_with_mqa,
  `linear_kv_up_proj` -> kv_b_proj (both per head [nope; rope] / [k_nope; v] as in HF),
  `q_layernorm` / `kv_layernorm` -> q_a_layernorm / kv_a_layernorm; the router's
  `expert_bias` buffer -> `mlp.gate.e_score_correction_bias`; shared experts.

HF shapes come from the HF config (`weightwire.plan.rules.hf_tensors`), the one the
engines are built from; every local tensor is checked against them. Anything that does
not map raises RegistrationError naming every such parameter; nothing is registered then.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightwire.protocol.errors import ErrorCode, RegistrationError
from weightwire.protocol.tensors import Box

from .inputs import storageless

MERGED_ROWS = "a local tensor with one dimension more than its box: dims 0 and 1 are its rows"

Skip = Callable[[str], bool]


@dataclass(frozen=True)
class Ranks:
    """Where this rank sits: tensor, expert and expert-tensor parallel rank and size."""

    tp: int = 0
    tp_size: int = 1
    ep: int = 0
    ep_size: int = 1
    etp: int = 0
    etp_size: int = 1

    @classmethod
    def from_parallel_state(cls) -> Ranks:
        from megatron.core import parallel_state as ps

        etp_size = getattr(ps, "get_expert_tensor_parallel_world_size", lambda: None)()
        return cls(
            tp=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            ep=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp=ps.get_expert_tensor_parallel_rank() if etp_size else 0,
            etp_size=etp_size or 1,
        )


@dataclass
class MegatronPiece:
    name: str  # HF name
    shape: tuple[int, ...]  # the HF tensor's
    box: Box  # of it, held here
    local: torch.Tensor  # a view of the parameter (MERGED_ROWS for interleaved QKV)
    param: str  # the Megatron parameter it is part of


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(
    r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$"
)
_SIMPLE = {  # Megatron layer suffix -> HF layer suffix (after model.layers.N.)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
_FC1 = {  # fused [gate; up] -> HF prefix
    "mlp.linear_fc1.weight": "mlp.",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts.",
}


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module: `.module`)."""
    while not hasattr(model, "decoder") and isinstance(
        getattr(model, "module", None), torch.nn.Module
    ):
        inner = model.module
        assert isinstance(inner, torch.nn.Module)
        model = inner
    return model


def _tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    with torch.no_grad():
        for name, p in model.named_parameters():
            yield name, p.detach()
        for name, b in model.named_buffers():
            if name.endswith("router.expert_bias"):  # a buffer in Megatron, a weight in HF
                yield name, b.detach()


class _Mapper:
    def __init__(
        self, config: Mapping[str, Any], ranks: Ranks, shapes: dict[str, tuple[int, ...]]
    ) -> None:
        self.config, self.ranks, self.shapes = config, ranks, shapes
        self.mla = "kv_lora_rank" in config
        self.vocab = int(config["vocab_size"])
        self.tied = bool(config.get("tie_word_embeddings"))
        self.experts = int(config.get("num_experts") or config.get("n_routed_experts") or 0)

    def shape(self, hf: str) -> tuple[int, ...]:
        shape = self.shapes.get(hf)
        if shape is None:
            raise ValueError(f"maps to {hf}, which the HF config has no tensor of")
        return shape

    def sharded(self, hf: str, local: torch.Tensor, rank: int, size: int) -> MegatronPiece:
        """`local` is whole, or the rank's chunk of the one dimension it is smaller on."""
        shape = self.shape(hf)
        dims = [d for d, (a, b) in enumerate(zip(local.shape, shape, strict=False)) if a != b]
        if local.dim() != len(shape) or len(dims) > 1:
            raise ValueError(
                f"is {list(local.shape)}, not a one-dimension shard of {hf} {list(shape)}"
            )
        if not dims:
            return MegatronPiece(hf, shape, Box.full(shape), local, "")
        d = dims[0]
        n = local.shape[d]
        if n * size != shape[d]:
            raise ValueError(
                f"is {list(local.shape)}: {size} shards of dimension {d} do not make {hf} "
                f"{list(shape)}"
            )
        return MegatronPiece(hf, shape, Box.rows(shape, rank * n, (rank + 1) * n, d), local, "")

    def fc1(self, prefix: str, local: torch.Tensor, rank: int, size: int) -> list[MegatronPiece]:
        """[gate; up]: the first half of the local rows are gate_proj's, the second up_proj's."""
        half = local.shape[0] // 2
        if local.shape[0] != 2 * half:
            raise ValueError(f"has {local.shape[0]} rows: not [gate; up] halves")
        return [
            self.sharded(prefix + "gate_proj.weight", local[:half], rank, size),
            self.sharded(prefix + "up_proj.weight", local[half:], rank, size),
        ]

    def vocab_rows(self, hf: str, local: torch.Tensor) -> list[MegatronPiece]:
        """Rows [r*n, (r+1)*n) of the padded table; only those below the HF vocabulary."""
        shape = self.shape(hf)
        n, r = local.shape[0], self.ranks.tp
        if n * self.ranks.tp_size < shape[0] or tuple(local.shape[1:]) != shape[1:]:
            raise ValueError(
                f"is {list(local.shape)} on {self.ranks.tp_size} TP ranks: less than {hf} "
                f"{list(shape)}"
            )
        start, stop = min(r * n, shape[0]), min((r + 1) * n, shape[0])
        if stop == start:
            return []  # this rank holds only padding
        return [MegatronPiece(hf, shape, Box.rows(shape, start, stop), local[: stop - start], "")]

    def qkv(self, prefix: str, kind: str, local: torch.Tensor) -> list[MegatronPiece]:
        """Interleaved per query group: [q heads of g; k_g; v_g] for each group g held."""
        q_shape = self.shape(f"{prefix}q_proj.{kind}")
        k_shape = self.shape(f"{prefix}k_proj.{kind}")
        heads = int(self.config["num_attention_heads"])
        groups = int(self.config.get("num_key_value_heads") or heads)
        d = k_shape[0] // groups
        per = heads // groups
        tp, size = self.ranks.tp, self.ranks.tp_size
        if groups % size:
            raise ValueError(f"{groups} query groups do not divide over {size} TP ranks")
        held = groups // size
        rest = tuple(local.shape[1:])
        if tuple(local.shape) != (held * (per + 2) * d, *rest) or rest != q_shape[1:]:
            raise ValueError(
                f"is {list(local.shape)}, not {held} query groups of {per} q heads, k and v "
                f"({d} rows each) of width {list(q_shape[1:])}"
            )
        g = local.view(held, (per + 2) * d, *rest)
        out = []
        for part, lo, hi, rows in (
            ("q_proj", 0, per * d, per * d),
            ("k_proj", per * d, (per + 1) * d, d),
            ("v_proj", (per + 1) * d, (per + 2) * d, d),
        ):
            hf = f"{prefix}{part}.{kind}"
            shape = self.shape(hf)
            view = g[:, lo:hi]
            if held == 1:
                view = view[0]  # a plain row range of the local tensor
            box = Box.rows(shape, tp * held * rows, (tp + 1) * held * rows)
            out.append(MegatronPiece(hf, shape, box, view, ""))
        return out

    def layer(self, hf_layer: int, rest: str, local: torch.Tensor) -> list[MegatronPiece]:
        r = self.ranks
        prefix = f"model.layers.{hf_layer}."
        expert = _EXPERT.match(rest)
        if expert is not None:
            j = int(expert.group(1) if expert.group(1) is not None else expert.group(4))
            fc = expert.group(2) or expert.group(3)
            if not self.experts or self.experts % r.ep_size:
                raise ValueError(f"{self.experts} experts do not divide over {r.ep_size} EP ranks")
            e = r.ep * (self.experts // r.ep_size) + j
            ep = f"{prefix}mlp.experts.{e}."
            if fc == "linear_fc1":
                return self.fc1(ep, local, r.etp, r.etp_size)
            return [self.sharded(ep + "down_proj.weight", local, r.etp, r.etp_size)]
        if re.fullmatch(r"mlp\.experts\.weight[12]", rest):
            raise ValueError(
                "is legacy GroupedMLP's (every local expert, transposed, in one tensor): no "
                "box of an HF tensor; use SequentialMLP or TEGroupedMLP experts"
            )
        if rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            if kind in ("weight", "bias"):
                return self.qkv(prefix + "self_attn.", kind, local)
        if rest in _FC1:
            return self.fc1(prefix + _FC1[rest], local, r.tp, r.tp_size)
        if rest == "self_attention.q_layernorm.weight":
            hf = "self_attn.q_a_layernorm.weight" if self.mla else "self_attn.q_norm.weight"
            return [self.sharded(prefix + hf, local, 0, 1)]
        simple = _SIMPLE.get(rest)
        if simple is None:
            raise ValueError("is no parameter of a known family's layer")
        return [self.sharded(prefix + simple, local, r.tp, r.tp_size)]

    def top(self, name: str, local: torch.Tensor) -> list[MegatronPiece]:
        if name == "embedding.word_embeddings.weight":
            return self.vocab_rows("model.embed_tokens.weight", local)
        if name == "output_layer.weight":
            return [] if self.tied else self.vocab_rows("lm_head.weight", local)
        if name == "decoder.final_layernorm.weight":
            return [self.sharded("model.norm.weight", local, 0, 1)]
        raise ValueError("is no parameter of a known family's model")


def megatron_pieces(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    config: Mapping[str, Any],
    ranks: Ranks | None = None,
    *,
    dtype: str = "bfloat16",
    skip: Skip | None = None,
) -> list[MegatronPiece]:
    """Every box of an HF tensor this rank's Megatron model (or virtual-pipeline chunks)
    holds. `config`: the HF config the engines use. `ranks`: default from Megatron's
    parallel_state. `skip(name)`: leave a Megatron parameter out (e.g. MTP layers).
    Raises RegistrationError naming every parameter that does not map."""
    from weightwire.plan.rules import hf_tensors

    ranks = ranks or Ranks.from_parallel_state()
    try:
        shapes = {t.name: t.shape for t in hf_tensors(config, dtype)}
    except Exception as exc:
        raise RegistrationError(
            f"cannot read the HF config: {exc}", code=ErrorCode.INVALID
        ) from exc
    mapper = _Mapper(config, ranks, shapes)
    chunks = list(model) if isinstance(model, Sequence) else [model]
    out: list[MegatronPiece] = []
    problems: list[str] = []
    for chunk in chunks:
        gpt = _unwrap(chunk)
        layers = getattr(getattr(gpt, "decoder", None), "layers", None)
        numbers = [int(layer.layer_number) - 1 for layer in layers] if layers is not None else []
        for raw, local in _tensors(gpt):
            name = raw.removeprefix("module.")
            if skip is not None and skip(name):
                continue
            if (why := storageless(local)) is not None:
                problems.append(f"parameter {raw} {why}")
                continue
            try:
                m = _LAYER.fullmatch(name)
                if m is not None:
                    got = mapper.layer(numbers[int(m.group(1))], m.group(2), local)
                else:
                    got = mapper.top(name, local)
            except ValueError as exc:
                problems.append(f"parameter {raw} {list(local.shape)}: {exc}")
                continue
            for piece in got:
                piece.param = raw
            out.extend(got)
    seen: dict[str, str] = {}
    for piece in out:
        if piece.name in seen:
            problems.append(
                f"parameters {seen[piece.name]} and {piece.param} both hold {piece.name}"
            )
        seen[piece.name] = piece.param
    if problems:
        raise RegistrationError(
            "cannot register the Megatron model (nothing was registered):\n  "
            + "\n  ".join(problems),
            code=ErrorCode.INVALID,
        )
    return out


class MegatronSource:
    """A registered Megatron model: its pieces, and where its parameters' storage was then.

    A parameter given new storage (offloaded to the CPU and back, as RL frameworks do
    between rollouts) leaves the registered views on the old storage; `moved` finds that
    and gives the new views, so a publish never sends stale weights."""

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        config: Mapping[str, Any],
        ranks: Ranks | None,
        skip: Skip | None,
    ) -> None:
        self.model, self.config, self.skip = model, config, skip
        self.ranks = ranks or Ranks.from_parallel_state()
        self.pieces = megatron_pieces(model, config, self.ranks, skip=skip)
        self._where = self._storage()

    def _storage(self) -> list[int]:
        chunks = list(self.model) if isinstance(self.model, Sequence) else [self.model]
        return [t.data_ptr() for c in chunks for _, t in _tensors(_unwrap(c))]

    def release(self, keep: set[str]) -> None:
        """Hold none of the parameters' storage (but the pieces named in `keep`): the next
        `moved` finds every other piece where it is then."""
        for p in self.pieces:
            if p.name not in keep:
                p.local = torch.empty(0, dtype=p.local.dtype, device=p.local.device)
        self._where = []

    def moved(self) -> dict[str, torch.Tensor]:
        """{HF name: its view now} for every piece whose parameter has new storage since
        registration (or the last call that found some); empty when none moved."""
        where = self._storage()
        if where == self._where:
            return {}
        old = {p.name: p.local for p in self.pieces}
        self.pieces = megatron_pieces(self.model, self.config, self.ranks, skip=self.skip)
        self._where = where
        return {
            p.name: p.local
            for p in self.pieces
            if p.name in old and p.local.data_ptr() != old[p.name].data_ptr()
        }
