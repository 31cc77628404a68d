"""What a trainer rank's delta sender may still count on after a replan: the engine ranks
it writes exactly as before keep what they verifiably held (so one replica that restarts
sends only itself dense, not every replica of the job)."""

from __future__ import annotations

from weightwire.protocol.plan import RankPlan

Dst = tuple[str, int]  # (engine node, immediate slot)


def unchanged(old: RankPlan | None, new: RankPlan, held: dict[Dst, int]) -> dict[Dst, int]:
    """What the engine ranks hold that a replan leaves as it was: those this rank writes
    exactly as before (every write: bucket, staging bytes read, destination region and
    offsets, and the same region id, so not an engine rank that registered again), with the
    same shadow. A restarted or moved engine rank, or a new staging layout, holds nothing
    known: dense. (The engine's base check stays the backstop.)"""
    if old is None or old.shadow_bytes != new.shadow_bytes:
        return {}

    def parts(p: RankPlan) -> dict[Dst, list[tuple[object, ...]]]:
        out: dict[Dst, list[tuple[object, ...]]] = {}
        for b in p.buckets:
            for w in b.writes:
                out.setdefault((w.dst_node, w.slot), []).append(
                    (b.index, w.src_offset, w.src_region, w.src_stride, w.length, w.count,
                     w.dst_rank, w.dst_region, w.dst_offset, w.dst_stride)
                )  # fmt: skip
        return out

    before, after = parts(old), parts(new)
    # a region's keys may be rotated on a replan; its id is never reused by the daemon
    regions = {(r.node, r.id): (r.kind, r.length) for r in old.regions}
    now = {(r.node, r.id): (r.kind, r.length) for r in new.regions}
    kept = {}
    for dst, version in held.items():
        writes = after.get(dst)
        if version < 0 or not writes or writes != before.get(dst):
            continue
        ids = {(dst[0], w[7]) for w in writes}
        if all(key in regions and regions[key] == now.get(key) for key in ids):
            kept[dst] = version
    return kept
