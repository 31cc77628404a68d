"""Logging, configured once in the entry point: structlog JSON, one object per line.

A line the output cannot take (a full disk, a file-size limit, a closed pipe) is dropped
and counted, never raised into the code that logged it: logging must not stop the daemon
in the middle of a version. The next line that gets through is preceded by one that says
how many were dropped."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any, TextIO

import structlog


class LineWriter:
    """A structlog logger that writes each line whole to a stream's file descriptor (no
    Python buffer that a failed flush would leave half written), or to the stream itself
    when it has none. Failures drop the line (`dropped` counts them)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        try:
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):
            self._fd = None
        self._lock = threading.Lock()
        self.dropped = 0
        self._torn = False  # a failed write left part of a line: end it before the next

    def msg(self, message: str) -> None:
        data = message.encode("utf-8", "backslashreplace") + b"\n"
        with self._lock:
            if self.dropped:
                note = {
                    "event": "log lines dropped",
                    "dropped": self.dropped,
                    "level": "warning",
                    "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
                data = json.dumps(note).encode() + b"\n" + data
            if self._torn:
                data = b"\n" + data
            if self._write(data):
                self.dropped = 0
                self._torn = False
            else:
                self.dropped += 1

    def _write(self, data: bytes) -> bool:
        if self._fd is None:
            try:
                self._stream.write(data.decode())
                self._stream.flush()
            except (OSError, ValueError):
                return False
            return True
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._fd, view)
            except InterruptedError:
                continue
            except OSError:  # ENOSPC, EFBIG (file-size limit; SIGXFSZ is ignored), EPIPE
                self._torn = self._torn or len(view) < len(data)
                return False
            view = view[n:]
        return True

    log = debug = info = warn = warning = err = error = critical = exception = msg
    failure = fatal = msg


_writer: LineWriter | None = None


def dropped() -> int:
    """Lines dropped since the last one that got through (0 when logging works)."""
    return _writer.dropped if _writer is not None else 0


def configure(level: str = "info", stream: TextIO | None = None) -> None:
    global _writer
    numeric = getattr(logging, level.upper())
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(message)s")
    _writer = LineWriter(stream or sys.stdout)
    writer = _writer

    def factory(*_: Any) -> LineWriter:
        return writer

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
