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


def serve(rank: int, handlers: dict[str, Callable[[dict[str, Any]], None]]) -> None:
    """Says `started`, runs each command's handler until `close` (or the end of stdin)."""
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
