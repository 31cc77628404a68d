"""The planner's work, on arrays: every engine rank's chunks laid end to end (one table
per distinct tensor list), their senders chosen, each trainer rank's packs laid out in
staging and cut into buckets, and every bucket's writes; the result kept as arrays
(`compact.Compact`), node plans made from them when asked for.

Equal, write for write, to the straightforward planner (one object per piece, kept in
tests/planref.py): tests/test_plan_equivalence.py.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from weightwire.protocol.errors import PlanError
from weightwire.protocol.tensors import ITEMSIZE, Cast, Copy, Fp8BlockScale

from .checks import check_destination
from .choose import choose
from .compact import Compact, PlanSet
from .items import Chunker, Keys, Table
from .options import PlanOptions
from .ranks import EngineRank, TrainerRank, _names
from .sources import SourceIndex
from .staging import pack_layout
from .writes import writes_of


def build(
    job: str,
    trainers: list[TrainerRank],
    engines: list[EngineRank],
    options: PlanOptions,
    slots: dict[int, int],
    progress: Callable[[str], None] | None = None,
) -> PlanSet:
    """`planner.plan` once its ranks are sorted by rank and its slots known."""
    say = progress or (lambda _msg: None)
    index = SourceIndex([(t.node, t.rank, t.tensors) for t in trainers])
    chunker = Chunker(index, options)
    say(f"chunking the pieces of {len(engines)} engine ranks")
    tables = [chunker.table(e.tensors) for e in engines]
    used = set[str]().union(*(t.sources for t in tables))
    unused = sorted(set(index.boxes) - used)
    if (
        any(t.problems for t in tables)
        or any(_region_problem(e, t) for e, t in zip(engines, tables, strict=True))
        or (unused and not options.allow_unused_sources)
    ):
        raise PlanError(_problems(job, engines, index, chunker, options))

    lengths = np.asarray([len(t) for t in tables], dtype=np.int64)
    engine = np.repeat(np.arange(len(engines), dtype=np.int64), lengths)

    def cat(col: str) -> np.ndarray:
        parts = [getattr(t, col) for t in tables]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    key, nbytes, dst_offset, region = cat("key"), cat("nbytes"), cat("dst_offset"), cat("region")
    say(f"choosing the senders of {key.shape[0]:,} chunks")
    group = cat("group")
    if options.share_keys and key.shape[0]:
        # one choice per chunk key, charged with all its copies: the replicas' copies of
        # a chunk come from one rank, staged (and, in a delta version, compared) once
        _, first, inv, copies = np.unique(
            key, return_index=True, return_inverse=True, return_counts=True
        )
        order = np.argsort(first, kind="stable")  # in chunk order, as `choose` expects
        picked = choose(group[first[order]], (nbytes[first] * copies)[order],
                        chunker.groups, len(trainers))  # fmt: skip
        per_key = np.empty_like(picked)
        per_key[order] = picked
        chosen = per_key[inv.reshape(-1)]
    else:
        chosen = choose(group, nbytes, chunker.groups, len(trainers))
    say("laying out staging")
    keys = chunker.keys
    key_align = np.asarray(
        [4 if isinstance(tr, Fp8BlockScale) else 16 for tr in keys.transform], dtype=np.int64
    )
    declared = {id(t.tensors): t.tensors for t in trainers}.values()
    zc = any(s.region >= 0 for tensors in declared for s in tensors)
    packs = pack_layout(
        chosen,
        key,
        cat("block"),
        cat("expert").astype(bool),
        np.asarray(keys.nbytes, dtype=np.int64),
        key_align,
        len(trainers),
        options.bucket_bytes,
        partial(_zero_copy, index, keys) if zc else None,
        options.tail_bytes,
    )
    say("cutting writes")
    pack = packs.of_item
    node_order = sorted(range(len(engines)), key=lambda i: (engines[i].node, engines[i].rank))
    engine_order = np.empty(len(engines), dtype=np.int64)
    engine_order[np.asarray(node_order, dtype=np.int64)] = np.arange(len(engines))
    writes = writes_of(
        bucket=packs.bucket[pack],
        engine=engine,
        engine_order=engine_order,
        region=region,
        src_region=packs.region[pack],
        src=packs.offset[pack],
        dst=dst_offset,
        nbytes=nbytes,
        options=options,
        bucket_lanes=np.asarray([t.lanes for t in trainers], dtype=np.int64)[packs.b_trainer],
        engine_lanes=np.asarray([e.lanes for e in engines], dtype=np.int64),
    )
    compact = Compact(
        job=job,
        options=options,
        trainers=trainers,
        engines=engines,
        index=index,
        keys=keys,
        packs=packs,
        writes=writes,
        slots=slots,
        expect_count=np.bincount(writes.engine, minlength=len(engines)).astype(np.int64),
        expect_bytes=_sum_by(engine, nbytes, len(engines)),
        expect_sources=_sources(engine, chosen, trainers, len(engines)),
        regions=_regions(chosen, engine, region, trainers, engines),
    )
    compact.plan_hash = compact.digest()
    return PlanSet(compact)


def _sum_by(group: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.int64)
    np.add.at(out, group, values)
    return out


def _sources(
    engine: np.ndarray, chosen: np.ndarray, trainers: list[TrainerRank], n: int
) -> list[tuple[str, ...]]:
    """The trainer nodes that write to each engine rank."""
    nodes = sorted({t.node for t in trainers})
    node_id = np.asarray([nodes.index(t.node) for t in trainers], dtype=np.int64)
    pairs = np.unique(engine * len(nodes) + node_id[chosen])
    out: list[list[str]] = [[] for _ in range(n)]
    for p in pairs.tolist():
        out[p // len(nodes)].append(nodes[p % len(nodes)])
    return [tuple(x) for x in out]


def _regions(
    chosen: np.ndarray,
    engine: np.ndarray,
    region: np.ndarray,
    trainers: list[TrainerRank],
    engines: list[EngineRank],
) -> list[list[tuple[str, int]]]:
    """Per trainer, the (node, region) pairs it writes to, sorted."""
    out: list[set[tuple[str, int]]] = [set() for _ in trainers]
    if chosen.size:
        span = int(region.max()) + 1
        pairs = np.unique((chosen * len(engines) + engine) * span + region)
        for p in pairs.tolist():
            t, rest = divmod(p, len(engines) * span)
            e, r = divmod(rest, span)
            out[t].add((engines[e].node, r))
    return [sorted(x) for x in out]


def _zero_copy(index: SourceIndex, keys: Keys, t: int, k: int) -> tuple[int, int] | None:
    """(region, offset) of a pack whose bytes already lie, as the engine wants them, in a
    region of the rank: an untransformed, contiguous part of a tensor declared in a region."""
    held = index.tensor(t, keys.source[k])
    transform = keys.transform[k]
    same = isinstance(transform, Copy) or (
        isinstance(transform, Cast) and transform.dtype == held.dtype
    )
    if held.region < 0 or not same:
        return None
    shape = held.held().sizes
    box = keys.box[k].relative_to(held.held())
    lead = next((d for d in range(len(shape)) if box.sizes[d] != 1), len(shape) - 1)
    if any(box.offsets[d] or box.sizes[d] != shape[d] for d in range(lead + 1, len(shape))):
        return None  # not contiguous in the rank's tensor: it must be packed
    linear = 0
    for o, n in zip(box.offsets, shape, strict=True):
        linear = linear * n + o
    return held.region, held.offset + linear * ITEMSIZE[held.dtype]


def _region_problem(e: EngineRank, table: Table) -> bool:
    lengths = {r.id: r.length for r in e.regions}
    return any(lengths.get(r, -1) < end for r, end in table.regions.items())


def _problems(
    job: str,
    engines: list[EngineRank],
    index: SourceIndex,
    chunker: Chunker,
    options: PlanOptions,
) -> str:
    """Every problem, engine by engine and tensor by tensor (only when there are some)."""
    problems: list[str] = []
    used: set[str] = set()
    checked: dict[tuple[object, ...], str | None] = {}
    for e in engines:
        regions = {r.id: r for r in e.regions}
        for dst in e.tensors:
            problem = check_destination(dst, regions, index, checked)
            if problem:
                problems.append(f"engine rank {e.rank}: {problem}")
                continue
            assert dst.pieces is not None
            for piece in dst.pieces:
                if not piece.sent:
                    continue
                used.add(piece.source)
                chunks = chunker.chunks(piece)
                if isinstance(chunks, str):
                    problems.append(f"engine rank {e.rank}: {dst.name}{chunks}")
    unused = sorted(set(index.boxes) - used)
    if unused and not options.allow_unused_sources:
        problems.append(f"source tensors no destination uses: {_names(unused)}")
    return "cannot plan job " + repr(job) + ":\n  " + "\n  ".join(problems)
