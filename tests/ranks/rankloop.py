"""What the torch.distributed trainer ranks (fsdp2_trainer.py, megatron_trainer.py) share:
their arguments, the gloo process group, and the command loop (one JSON object a line on
stdin, events on stdout; a WeightwireError is reported and the rank goes on, anything else
ends it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from weightwire.client import Trainer
from weightwire.client.delta.sender import Mode
from weightwire.protocol.errors import WeightwireError


def say(**kw: object) -> None:
    print(json.dumps({**kw, "t": time.time()}), flush=True)


def start(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Parses the common arguments (and whatever `ap` already has), joins the gloo group."""
    ap.add_argument("--socket", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=a.world
    )
    return a


class Ranked:
    """The rank's current Trainer: a new one (the old one closed) at each setup."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.tr: Trainer | None = None

    def trainer(self, job: str, delta: Mode = "off") -> Trainer:
        self.close()
        self.tr = Trainer(
            self.a.rank, self.a.world, socket=self.a.socket, job=job, timeout_s=60, delta=delta
        )
        return self.tr

    def publish(self, version: int) -> None:
        assert self.tr is not None
        s = self.tr.publish(version)
        say(
            event="published", rank=self.a.rank, version=version, bytes=s.nbytes,
            delta_bytes=s.delta_bytes,
        )  # fmt: skip

    def close(self) -> None:
        if self.tr is not None:
            self.tr.close()
            self.tr = None


def serve(ranked: Ranked, handlers: dict[str, Callable[[dict[str, Any]], None]]) -> None:
    """Says `started`, runs each command's handler until `close` (or the end of stdin), then
    closes the trainer and leaves the process group."""
    rank = ranked.a.rank
    say(event="started", rank=rank)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "close":
            break
        try:
            handlers[msg["cmd"]](msg)
        except WeightwireError as exc:
            say(event="error", rank=rank, code=exc.code.value, message=exc.message)
        except Exception as exc:
            say(event="error", rank=rank, code="exception", message=traceback.format_exc())
            raise SystemExit(1) from exc
    ranked.close()
    dist.destroy_process_group()
