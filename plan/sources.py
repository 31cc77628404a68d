"""Who holds what, and which holder sends each piece: the least-loaded rank among those
that hold it, in O(log n) per choice.

Ranks that declare the same tensors (a shared tuple, or equal content) are indexed once;
holders of a tensor are grouped by the box they hold; each distinct set of candidate
ranks keeps a heap of (bytes assigned, rank), updated lazily as ranks are charged.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

from weightwire.protocol.errors import PlanError
from weightwire.protocol.tensors import Box, SourceTensor

from .boxes import fmt_box


@dataclass(frozen=True)
class Holder:
    node: str
    rank: int
    tensor: SourceTensor
    index: int  # position among the trainers, sorted by rank


class SourceIndex:
    def __init__(self, trainers: list[tuple[str, int, tuple[SourceTensor, ...]]]) -> None:
        """`trainers`: (node, rank, tensors) sorted by rank."""
        self.nodes = [node for node, _, _ in trainers]
        self.ranks = [rank for _, rank, _ in trainers]
        self.load = [0] * len(trainers)
        self._tensors = [tensors for _, _, tensors in trainers]
        self._by_tuple: dict[int, dict[str, SourceTensor]] = {}
        # name -> [(box held, candidate rank indices)]
        self.boxes: dict[str, list[tuple[Box, tuple[int, ...]]]] = {}
        self._heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._choices: dict[tuple[str, Box], tuple[int, ...]] = {}
        self._index()

    def _index(self) -> None:
        problems: list[str] = []
        same: dict[int, list[int]] = defaultdict(list)  # id(tensors) -> rank indices
        for i, tensors in enumerate(self._tensors):
            same[id(tensors)].append(i)
        if len(same) == 1 and self._index_one(next(iter(same.values()))):
            return
        # per name, the rank groups (ranks sharing one declaration) holding each box
        boxes: dict[str, dict[Box, list[list[int]]]] = defaultdict(dict)
        kinds: dict[str, dict[tuple[str, tuple[int, ...]], list[list[int]]]] = defaultdict(dict)
        for members in same.values():
            tensors = self._tensors[members[0]]
            seen: set[str] = set()
            for s in tensors:
                if s.name in seen:
                    problems.append(
                        f"trainer rank {self.ranks[members[0]]} declares {s.name} twice"
                    )
                seen.add(s.name)
                held = s.held()
                if s.box is not None and not held.within(s.shape):
                    problems.append(
                        f"trainer rank {self.ranks[members[0]]}: {s.name} box {fmt_box(held)} is "
                        f"outside its shape {list(s.shape)}"
                    )
                boxes[s.name].setdefault(held, []).append(members)
                kinds[s.name].setdefault((s.dtype, s.shape), []).append(members)
        for name, by_kind in kinds.items():
            if len(by_kind) > 1:
                desc = ", ".join(
                    f"rank {self.ranks[i]}: {dtype}{list(shape)}"
                    for (dtype, shape), groups in by_kind.items()
                    for members in groups
                    for i in members
                )
                problems.append(f"trainer ranks disagree on {name}: {desc}")
        if problems:
            raise PlanError("inconsistent sources:\n  " + "\n  ".join(problems))
        # equal candidate tuples are one object (one per declaration group, mostly)
        interned: dict[tuple[int, ...], tuple[int, ...]] = {}
        of_group: dict[int, tuple[int, ...]] = {}

        def candidates(groups: list[list[int]]) -> tuple[int, ...]:
            if len(groups) == 1:
                hit = of_group.get(id(groups[0]))
                if hit is None:
                    t = tuple(sorted(groups[0]))
                    hit = of_group[id(groups[0])] = interned.setdefault(t, t)
                return hit
            t = tuple(sorted(i for g in groups for i in g))
            return interned.setdefault(t, t)

        self.boxes = {
            name: [(box, candidates(groups)) for box, groups in by_box.items()]
            for name, by_box in boxes.items()
        }
        self.meta = {
            name: next(iter(by_kind)) for name, by_kind in kinds.items()
        }  # name -> (dtype, shape)
        self._whole = {
            name: boxes[0][1]
            for name, boxes in self.boxes.items()
            if len(boxes) == 1 and boxes[0][0] == Box.full(self.meta[name][1])
        }
        # name -> an id shared by sources of one dtype, shape and holders (layers repeat)
        shapes: dict[tuple[object, ...], int] = {}
        self.shape_id = {
            name: shapes.setdefault(
                (*self.meta[name], tuple((box, id(c)) for box, c in held)), len(shapes)
            )
            for name, held in self.boxes.items()
        }

    def _index_one(self, members: list[int]) -> bool:
        """Every rank declares the same tensors (one tuple): each name has one holder box
        and one candidate tuple. False when the declaration has problems (the general
        path names them)."""
        tensors = self._tensors[members[0]]
        cand = tuple(sorted(members))
        boxes: dict[str, list[tuple[Box, tuple[int, ...]]]] = {}
        meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        whole: dict[str, tuple[int, ...]] = {}
        shape_id: dict[str, int] = {}
        shapes: dict[tuple[object, ...], int] = {}
        for s in tensors:
            if s.name in meta:
                return False
            shape = s.shape
            meta[s.name] = (s.dtype, shape)
            if s.box is None or s.box == Box.full(shape):
                held = Box.full(shape)
                whole[s.name] = cand
                key: tuple[object, ...] = (s.dtype, shape)
            else:
                held = s.box
                if not held.within(shape):
                    return False
                key = (s.dtype, shape, held)
            boxes[s.name] = [(held, cand)]
            shape_id[s.name] = shapes.setdefault(key, len(shapes))
        self.boxes, self.meta, self._whole, self.shape_id = boxes, meta, whole, shape_id
        return True

    def held_boxes(self, name: str) -> list[Box]:
        return [box for box, _ in self.boxes.get(name, ())]

    def tensor(self, index: int, name: str) -> SourceTensor:
        tensors = self._tensors[index]
        lookup = self._by_tuple.get(id(tensors))
        if lookup is None:
            lookup = self._by_tuple[id(tensors)] = {s.name: s for s in tensors}
        return lookup[name]

    def candidates(self, name: str, sub: Box) -> tuple[int, ...]:
        """The indices of the ranks holding all of `sub`, sorted."""
        whole = self._whole.get(name)  # every holder has it whole: any of them will do
        return whole if whole is not None else self._candidates(name, sub)

    def choose(self, name: str, sub: Box) -> Holder:
        """The least-loaded rank holding all of `sub` (ties: the lowest rank)."""
        candidates = self._whole.get(name)  # every holder has it whole: any of them will do
        if candidates is None:
            candidates = self._candidates(name, sub)
        if len(candidates) == 1:
            i = candidates[0]
        else:
            heap = self._heaps.get(candidates)
            if heap is None:
                heap = self._heaps[candidates] = [(self.load[i], i) for i in candidates]
                heapq.heapify(heap)
            while True:
                load, i = heap[0]
                if load == self.load[i]:
                    break
                heapq.heapreplace(heap, (self.load[i], i))  # charged through another group
        return Holder(self.nodes[i], self.ranks[i], self.tensor(i, name), i)

    def _candidates(self, name: str, sub: Box) -> tuple[int, ...]:
        key = (name, sub)
        candidates = self._choices.get(key)
        if candidates is None:
            ranks: set[int] = set()
            for box, members in self.boxes[name]:
                if _contains(box, sub):
                    ranks.update(members)
            candidates = tuple(sorted(ranks))
            if len(self._choices) < 1 << 16:
                self._choices[key] = candidates
        return candidates

    def charge(self, holder: Holder, nbytes: int) -> None:
        self.load[holder.index] += nbytes


def _contains(outer: Box, inner: Box) -> bool:
    return all(
        o <= i and i + n <= o + m
        for o, m, i, n in zip(outer.offsets, outer.sizes, inner.offsets, inner.sizes, strict=True)
    )
