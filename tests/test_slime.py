"""The slime / miles recipe (`weightwire.adapters.slime.UpdateWeightFromWeightwire`) made and
called as slime's trainer actor makes and calls its weight updater, on four real
torch.distributed ranks (gloo, CPU) of megatron-core's own GPTModel (tests/ranks/
slime_trainer.py), through two real daemons, into two rollout engines.

Each rollout engine is what slime launches, one SGLang server with the weightwire plugin:
its TP ranks are `Engine` clients registered with SGLang's layout as one engine replica
(as the plugin registers a server's workers), and its HTTP side is the recording SGLang
stand-in of tests/test_sglang_lifecycle.py (SGLang 0.5.23's routes and payloads; a full
SGLang server cannot run here). The stand-in looks at the engine ranks' memory when the
recipe pauses generation (the previous version, untouched) and when it closes the weight
update session (the new version, complete): both checked bitwise against the test's own
Megatron->HF conversion (tests/test_megatron.py `to_hf`) of every rank's parameters.

- Qwen3 dense, TP 2 x PP 2, into two TP-2 engines;
- Qwen3-MoE, TP 2 x EP 2 (expert TP 1), into two TP-2 / EP-2 engines;

each over two versions, slime's first push (the weights as loaded) and one after a
training step (every tensor changed), then an update that engine 1 refuses at
begin_weight_update: every trainer rank reports it, no weight changes, both engines go
on generating; the next update lands."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from weightwire.client import Engine
from weightwire.client.dtypes import TORCH
from weightwire.harness.localcluster import LocalCluster
from weightwire.plan.rules import engine_tensors

from .multirank import Rank, out_dir, rank_procs
from .rulesref import CONFIGS, reference
from .test_megatron import DIVISIBLE_BY, to_hf
from .test_rules import layout
from .test_sglang_lifecycle import Call, RecordingSGLang

pytestmark = [pytest.mark.megatron, pytest.mark.slime]
WORLD = 4
ENGINES = 2

JOBS: dict[str, dict[str, Any]] = {
    "dense": dict(
        hf=dict(CONFIGS["qwen3"], num_key_value_heads=4), tp=2, pp=2, ep=1, etp=1, etp_e=2, eep=1
    ),
    "moe": dict(hf=CONFIGS["qwen3-moe"], tp=2, pp=1, ep=2, etp=1, etp_e=2, eep=2),
}


@dataclass
class RolloutEngine:
    """One slime rollout engine: its TP ranks' tensors and its SGLang HTTP stand-in, with
    what the stand-in saw of the tensors at pause_generation and end_weight_update."""

    ranks: list[Engine]
    tensors: list[dict[str, torch.Tensor]]
    server: RecordingSGLang
    at_pause: list[list[dict[str, torch.Tensor]]] = field(default_factory=list)
    at_end: list[tuple[list[int], list[dict[str, torch.Tensor]]]] = field(default_factory=list)

    def snapshot(self) -> list[dict[str, torch.Tensor]]:
        return [{n: t.clone() for n, t in ts.items()} for ts in self.tensors]

    def pause(self) -> None:
        self.at_pause.append(self.snapshot())

    def end(self) -> None:
        latest = [e.latest.version if e.latest else 0 for e in self.ranks]
        self.at_end.append((latest, self.snapshot()))


class Loop:
    """An asyncio loop on a thread of its own, serving the stand-ins while the test waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout=30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def ranks(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Rank]]:
    out = tmp_path_factory.mktemp("slime")
    with rank_procs("slime_trainer.py", cluster, out, WORLD, started_s=180) as procs:
        yield procs


def rollout_engines(
    cluster: LocalCluster, loop: Loop, hf: dict[str, Any], tp: int, ep: int, job: str
) -> list[RolloutEngine]:
    """`ENGINES` engines of TP `tp` / EP `ep` on daemon 1, registered as the SGLang plugin
    registers a server's TP workers: engine replica i, ranks i*tp.., zeroed tensors in
    SGLang's layout."""
    log: list[Call] = []
    out = []
    for i in range(ENGINES):
        engs, tensors = [], []
        for r in range(tp):
            lay = layout(hf, tp, r, ep, "")
            ts = {
                t.name: torch.zeros(t.shape, dtype=TORCH[t.dtype]) for t in engine_tensors(hf, lay)
            }
            eng = Engine(
                i * tp + r, ENGINES * tp, socket=cluster.daemons[1].socket, job=job,
                timeout_s=60, replica=i, replica_size=tp,
            )  # fmt: skip
            eng.register(ts, layout=lay)
            engs.append(eng)
            tensors.append(ts)
        server = loop.run(RecordingSGLang(f"engine{i}", log).start())
        e = RolloutEngine(engs, tensors, server)
        server.actions["/pause_generation"] = e.pause
        server.actions["/end_weight_update"] = e.end
        out.append(e)
    return out


def outcome(p: Rank, timeout: float = 120) -> dict[str, Any]:
    """The rank's next `updated` or `update_failed` event."""
    deadline = time.monotonic() + timeout
    with p._cv:
        while True:
            for e in p.events:
                if e["event"] in ("updated", "update_failed", "error") and not e.get("seen"):
                    e["seen"] = True
                    return e
            left = deadline - time.monotonic()
            assert left > 0 and p.p.poll() is None, (
                f"no update: {p.events}\n{''.join(p.err)[-3000:]}"
            )
            p._cv.wait(min(left, 0.2))


def update(ranks: list[Rank], train: bool) -> list[dict[str, Any]]:
    for p in ranks:
        p.cmd(cmd="update", train=train)
    got = [outcome(p) for p in ranks]
    assert all(e["event"] == "updated" for e in got), got
    return got


def expected(spec: dict[str, Any], job: str, ranks: list[Rank], version: int) -> list[Any]:
    """Each engine TP rank's tensors of `version`: the full HF model from every trainer
    rank's parameters (the test's own conversion), cut as SGLang holds it."""
    files = sorted(out_dir(ranks).glob(f"slime-{job}-v{version}-r*.pt"))
    assert len(files) == WORLD, files
    hf = spec["hf"]
    full = to_hf(hf, spec["tp"], spec["pp"], spec["ep"], spec["etp"], files)
    return [reference(hf, full, spec["etp_e"], r, spec["eep"], None) for r in range(spec["etp_e"])]


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), what
    for n, w in want.items():
        g = got[n]
        assert torch.equal(g.view(torch.uint8), w.contiguous().view(torch.uint8)), f"{what}: {n}"


def steps(server: RecordingSGLang) -> list[str]:
    return [c.path.lstrip("/") for c in server.calls]


SEQUENCE = [
    "pause_generation", "flush_cache", "begin_weight_update", "end_weight_update",
    "update_weight_version", "continue_generation",
]  # fmt: skip


@pytest.mark.parametrize("job", list(JOBS))
def test_slime_update_weights_lands_bitwise(
    cluster: LocalCluster, loop: Loop, ranks: list[Rank], job: str
) -> None:
    spec = JOBS[job]
    hf = spec["hf"]
    engines = rollout_engines(cluster, loop, hf, spec["etp_e"], spec["eep"], f"slime-{job}")
    try:
        for p in ranks:
            p.cmd(
                cmd="setup", job=f"slime-{job}", hf=hf, tp=spec["tp"], pp=spec["pp"],
                ep=spec["ep"], etp=spec["etp"], divisible_by=DIVISIBLE_BY,
                urls=[e.server.url for e in engines],
            )  # fmt: skip
        for p in ranks:
            p.wait_for("ready", timeout=180)
        before = [
            [{n: torch.zeros_like(t) for n, t in ts.items()} for ts in e.tensors] for e in engines
        ]
        wants = []
        for version, train in ((1, False), (2, True)):  # slime's first push, then a step's
            done = update(ranks, train)
            assert [d["version"] for d in done] == [version] * WORLD
            assert sum(d["weightwire/bytes"] for d in done) > 0
            assert all(d["weightwire/bytes"] > 0 for d in done), "every rank sends its own"
            want = expected(spec, job, ranks, version)
            wants.append(want)
            for i, e in enumerate(engines):
                assert steps(e.server) == SEQUENCE * version, steps(e.server)
                version_call = e.server.calls[-2]
                assert version_call.body["new_version"] == str(version)
                assert not e.server.paused and e.server.weight_version == str(version)
                for r in range(spec["etp_e"]):  # at pause: the previous version, untouched
                    same(e.at_pause[-1][r], before[i][r], f"{job} engine {i} rank {r} paused")
                latest, at_end = e.at_end[-1]
                # every rank's bytes were in place when the session closed (below); its own
                # notice of the version may still have been on the way (`latest` lags the
                # daemon's status, which the trainer side waits on), but it arrives
                for r, got in enumerate(latest):
                    if got != version:
                        assert got == version - 1, latest
                        assert e.ranks[r].wait(version, timeout_s=10).version == version
                for r in range(spec["etp_e"]):  # the session closes on the new version
                    same(at_end[r], want[r], f"{job} v{version} engine {i} rank {r}")
                before[i] = at_end
        for r in range(spec["etp_e"]):  # the step changed every tensor
            for n in wants[0][r]:
                assert not torch.equal(wants[0][r][n], wants[1][r][n]), f"{n} did not change"

        # engine 1 refuses to open its session: nothing lands, every rank says so,
        # both engines go on generating, and the next update lands
        engines[1].server.fail["/begin_weight_update"] = (400, {"success": False, "message": "no"})
        for p in ranks:
            p.cmd(cmd="update", train=True)
        failed = [outcome(p) for p in ranks]
        assert all(f["event"] == "update_failed" and f["version"] == 3 for f in failed), failed
        assert "begin_weight_update" in failed[0]["message"], failed[0]
        assert all("rank 0" in f["message"] for f in failed[1:]), failed
        tails = [steps(e.server)[-3:] for e in engines]  # engine 0's open session closed
        assert tails[0] == ["begin_weight_update", "end_weight_update", "continue_generation"]
        assert tails[1][-2:] == ["begin_weight_update", "continue_generation"]
        for i, e in enumerate(engines):
            assert not e.server.paused and not e.server.session_open
            for r in range(spec["etp_e"]):
                same(e.tensors[r], before[i][r], f"{job} engine {i} rank {r} after a refusal")
        del engines[1].server.fail["/begin_weight_update"]
        done = update(ranks, False)
        assert [d["version"] for d in done] == [4] * WORLD
        want = expected(spec, job, ranks, 4)
        for i, e in enumerate(engines):
            assert e.server.weight_version == "4"
            for r in range(spec["etp_e"]):
                same(e.at_end[-1][1][r], want[r], f"{job} v4 engine {i} rank {r}")
    finally:
        for e in engines:
            loop.run(e.server.stop())
            for eng in e.ranks:
                eng.close()


def test_engine_env_makes_each_engine_a_replica_of_the_job() -> None:
    from weightwire.adapters.slime import engine_env

    assert engine_env(1, 4, job="rl", socket="/run/ww.sock") == {
        "SGLANG_PLUGINS": "weightwire",
        "WEIGHTWIRE_SGLANG": "rules",
        "WEIGHTWIRE_JOB": "rl",
        "WEIGHTWIRE_ENGINE_REPLICA": "1",
        "WEIGHTWIRE_ENGINE_REPLICAS": "4",
        "WEIGHTWIRE_SOCKET": "/run/ww.sock",
    }
    with pytest.raises(ValueError, match="engine 4 of 4"):
        engine_env(4, 4)
    with pytest.raises(ValueError, match="mode='fast'"):
        engine_env(0, 1, mode="fast")


def test_hf_config_comes_from_the_argument_or_slimes_hf_checkpoint(tmp_path: Any) -> None:
    """A dict or a transformers-style config (`to_dict`), else `<hf_checkpoint>/config.json`;
    neither, or an unreadable file, is a RegistrationError that says what to set."""
    import argparse
    import json

    from weightwire.adapters.slime import hf_config_of
    from weightwire.protocol.errors import RegistrationError

    hf = CONFIGS["qwen3"]

    class Config:
        def to_dict(self) -> dict[str, Any]:
            return dict(hf)

    none = argparse.Namespace()
    assert hf_config_of(none, hf) == hf
    assert hf_config_of(none, Config()) == hf
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert hf_config_of(argparse.Namespace(hf_checkpoint=str(tmp_path))) == hf
    with pytest.raises(RegistrationError, match="hf_checkpoint"):
        hf_config_of(none)
    missing = argparse.Namespace(hf_checkpoint=str(tmp_path / "nothing"))
    with pytest.raises(RegistrationError, match=r"nothing/config\.json"):
        hf_config_of(missing)


def test_call_all_calls_plain_engine_objects_and_skips_urls_of_later_nodes() -> None:
    """Engines that are not ray actors are called directly; an engine spanning nodes
    answers get_url on its first node only (None from the others, left out)."""
    from weightwire.adapters.slime import call_all, engine_urls

    class Handle:
        def __init__(self, url: str | None) -> None:
            self.url = url

        def get_url(self) -> str | None:
            return self.url

        def echo(self, x: int, *, y: int) -> tuple[str | None, int, int]:
            return self.url, x, y

    handles = [Handle("http://a:1"), Handle(None), Handle("http://b:2")]
    assert engine_urls(handles) == ["http://a:1", "http://b:2"]
    assert call_all(handles, "echo", 1, y=2) == [
        ("http://a:1", 1, 2),
        (None, 1, 2),
        ("http://b:2", 1, 2),
    ]
