"""Writes the cuda transport resolved once, and the epoch that says when to resolve them
again."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from weightwire.transport.base import Prepared, WriteRequest

from .copies import Chunk


class Epoch:
    """Bumped whenever something a prepared write resolved may have changed (a region or
    a peer of any cuda transport of this process): prepared writes of an older epoch are
    resolved again before they are issued."""

    value = 0
    _lock = threading.Lock()

    @classmethod
    def bump(cls) -> None:
        with cls._lock:
            cls.value += 1


class CudaPrepared(Prepared):
    __slots__ = ("epoch", "failed", "lanes", "owner")

    def __init__(self, requests: Sequence[WriteRequest], owner: Any) -> None:
        super().__init__(requests)
        self.owner = owner  # the transport that resolved them
        self.epoch = -1  # the Epoch they were resolved in
        self.failed: list[tuple[int, BaseException]] = []  # (index, error): refused writes
        # ((copying device, destination device), the lane's chunks, from pageable memory)
        self.lanes: list[tuple[tuple[int, int], list[Chunk], bool]] = []
