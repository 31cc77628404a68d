"""What the multi-rank trainer tests (test_fsdp2, test_megatron) share: real rank processes
(tests/ranks/*_trainer.py, gloo on CPU) driven by JSON commands, SGLang-layout engines that
receive from them, and the bitwise check of what the engines got."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from weightwire.client import Engine
from weightwire.client.dtypes import TORCH
from weightwire.harness.localcluster import LocalCluster
from weightwire.plan.rules import engine_tensors

from .jsonproc import JsonLinesProc
from .rulesref import reference
from .test_rules import layout

HERE = Path(__file__).parent


class Rank(JsonLinesProc):
    def wait_for(self, event: str, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for e in self.events:
                    if e["event"] == "error":
                        raise AssertionError(f"rank failed: {e}\n{''.join(self.err)[-3000:]}")
                    if e["event"] == event and not e.get("seen"):
                        e["seen"] = True
                        return e
                left = deadline - time.monotonic()
                if left <= 0 or self.p.poll() is not None:
                    raise AssertionError(
                        f"no {event} in {timeout} s: {self.events}\n{''.join(self.err)[-3000:]}"
                    )
                self._cv.wait(min(left, 0.2))

    def cmd(self, **kw: object) -> None:
        self.send(json.dumps(kw))


@contextmanager
def rank_procs(
    script: str,
    cluster: LocalCluster,
    out: Path,
    world: int,
    *extra: str,
    started_s: float = 120,
) -> Iterator[list[Rank]]:
    """`world` ranks of tests/ranks/<script> on daemon 0, started; closed cleanly (exit 0)
    after the body, killed if anything failed."""
    procs = [
        Rank(
            HERE / "ranks" / script,
            *("--socket", cluster.daemons[0].socket, "--store", str(out / "store")),
            *("--rank", str(r), "--world", str(world), "--out", str(out)),
            *extra,
            pythonpath=HERE.parent,
        )
        for r in range(world)
    ]
    try:
        for p in procs:
            p.wait_for("started", timeout=started_s)
        yield procs
        for p in procs:
            p.cmd(cmd="close")
        for p in procs:
            assert p.finish() == 0, "".join(p.err)[-3000:]
    finally:
        for p in procs:
            p.kill()


def out_dir(ranks: list[Rank]) -> Path:
    argv = ranks[0].p.args
    return Path(argv[argv.index("--out") + 1])


def engine_group(
    cluster: LocalCluster,
    hf: dict[str, Any],
    tp: int,
    ep: int,
    job: str,
    first: int,
    world: int,
    delta_area: float = 0.0,
) -> tuple[list[Engine], list[dict[str, torch.Tensor]]]:
    """TP-`tp` / EP-`ep` engine ranks `first`.. of `world` on daemon 1, zeroed tensors
    registered with their SGLang layout (and a delta area of `delta_area`)."""
    engines, received = [], []
    sock = cluster.daemons[1].socket
    for r in range(tp):
        lay = layout(hf, tp, r, ep, "")
        tensors = {
            t.name: torch.zeros(t.shape, dtype=TORCH[t.dtype]) for t in engine_tensors(hf, lay)
        }
        eng = Engine(first + r, world, socket=sock, job=job, timeout_s=60, delta_area=delta_area)
        eng.register(tensors, layout=lay)
        engines.append(eng)
        received.append(tensors)
    return engines, received


def check_engines(
    hf: dict[str, Any],
    full: dict[str, torch.Tensor],
    ep: int,
    engines: list[Engine],
    received: list[dict[str, torch.Tensor]],
    version: int,
    what: str,
) -> None:
    """Waits for `version` on every engine rank and checks its tensors bitwise against the
    reference cut of the full HF model."""
    for r, eng in enumerate(engines):
        eng.wait(version, timeout_s=60)
        want = reference(hf, full, len(engines), r, ep, None)
        assert set(want) == set(received[r])
        for n, expected in want.items():
            got = received[r][n]
            assert torch.equal(got.view(torch.uint8), expected.contiguous().view(torch.uint8)), (
                f"{what} v{version} engine TP{len(engines)} rank {r}: {n} differs"
            )
