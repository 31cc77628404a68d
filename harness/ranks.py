"""A rank process driven over JSON lines: commands on its stdin, events on its stdout."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Rank:
    role: str
    rank: int
    proc: subprocess.Popen[str]
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)

    def start_reader(self) -> None:
        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                try:
                    self.events.put(json.loads(line))
                except json.JSONDecodeError:
                    sys.stderr.write(f"[{self.role} {self.rank}] {line}")
            self.events.put({"event": "exit", "code": self.proc.wait()})

        threading.Thread(target=read, daemon=True).start()

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def next(self, timeout_s: float) -> dict[str, Any]:
        try:
            ev = self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(
                f"{self.role} rank {self.rank} silent for {timeout_s:.0f} s"
            ) from None
        if ev["event"] in ("exit", "fatal"):
            raise RuntimeError(f"{self.role} rank {self.rank} stopped: {ev}")
        return ev
