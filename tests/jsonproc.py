"""A child process that prints one JSON object per line and reads commands on stdin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class JsonLinesProc:
    """Runs `prefix + [python, script, *args]`; its stdout lines land in `events`, its stderr
    lines in `err` (both drained by threads, so a chatty child never blocks on a full pipe)."""

    def __init__(
        self, script: Path, *args: str, pythonpath: Path, prefix: Sequence[str] = ()
    ) -> None:
        env = {**os.environ, "PYTHONPATH": str(pythonpath), "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(
            [*prefix, sys.executable, str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: list[dict[str, Any]] = []
        self.err: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self._cv:
                self.events.append(json.loads(line))
                self._cv.notify_all()

    def _read_err(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.err.append(line)

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def finish(self) -> int:
        """Closes stdin (the child's cue to exit) and returns its exit status."""
        assert self.p.stdin is not None
        self.p.stdin.close()
        try:
            return self.p.wait(60)
        finally:
            self.kill()

    def kill(self) -> None:
        """Kills the child if it still runs (a test's cleanup)."""
        if self.p.poll() is None:
            self.p.kill()
