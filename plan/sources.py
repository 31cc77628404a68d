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
        boxes: dict[str, dict[Box, list[int]]] = defaultdict(dict)
        kinds: dict[str, dict[tuple[str, tuple[int, ...]], list[int]]] = defaultdict(dict)
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
                boxes[s.name].setdefault(held, []).extend(members)
                kinds[s.name].setdefault((s.dtype, s.shape), []).extend(members)
        for name, by_kind in kinds.items():
            if len(by_kind) > 1:
                desc = ", ".join(
                    f"rank {self.ranks[i]}: {dtype}{list(shape)}"
                    for (dtype, shape), members in by_kind.items()
                    for i in members
                )
                problems.append(f"trainer ranks disagree on {name}: {desc}")
        if problems:
            raise PlanError("inconsistent sources:\n  " + "\n  ".join(problems))
        self.boxes = {
            name: [(box, tuple(sorted(members))) for box, members in by_box.items()]
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

    def held_boxes(self, name: str) -> list[Box]:
        return [box for box, _ in self.boxes.get(name, ())]

    def tensor(self, index: int, name: str) -> SourceTensor:
        tensors = self._tensors[index]
        lookup = self._by_tuple.get(id(tensors))
        if lookup is None:
            lookup = self._by_tuple[id(tensors)] = {s.name: s for s in tensors}
        return lookup[name]

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
