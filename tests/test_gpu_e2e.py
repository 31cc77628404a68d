"""End to end on GPUs: real daemons, trainer and engine clients holding CUDA tensors.

A small Qwen3-MoE: trainers hold FSDP-2 shards on their GPUs, engines hold SGLang TP-2
tensors on theirs (recipes from the rules, BF16 and FP8), every engine tensor compared
bitwise with the plain reference of tests/rulesref.py. Placement: with 4 GPUs trainers on
0,1 and engines on 2,3; with 2 or 3, trainers on 0 and engines on 1; with 1, all on it.

Paths:
- GPU staging through the `cuda` transport (CUDA IPC, one daemon);
- the pinned CPU replica copied into the engine GPUs by the `cuda` transport;
- the CPU replica at a second daemon with cuda off: tcp into the engine daemon, which
  lands it in GPU memory through its bounce buffers.

Needs a GPU: run by scripts/gpu-suite.sh; skipped elsewhere, saying why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from weightwire.client import Engine, Shard, Trainer
from weightwire.client.dtypes import TORCH
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.memory.cudadrv import available
from weightwire.plan.rules import engine_tensors
from weightwire.protocol.errors import ErrorCode, WeightwireError
from weightwire.protocol.local import BucketsLanded, EngineLayout

from .conftest import FAST, serve
from .hfweights import random_hf
from .rulesref import CONFIGS, reference

OK, WHY = available()
if OK and not torch.cuda.is_available():
    OK, WHY = False, "torch sees no CUDA device (a CPU build of torch?)"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")]

BOUNCE = 1 << 20  # gpu_cluster's tcp_bounce_bytes (the least there is)
CFG = CONFIGS["qwen3-moe-fp8"]  # Qwen3-MoE whose FSDP-2 and TP-2 slices are whole FP8 tiles


def device(index: int) -> torch.device:
    return torch.device("cuda", index)


def placement() -> tuple[list[int], list[int]]:
    n = torch.cuda.device_count()
    if n >= 4:
        return [0, 1], [2, 3]
    if n >= 2:
        return [0, 0], [1, 1]
    return [0, 0], [0, 0]


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[LocalCluster]:
    """host0: the coordinator, cuda on (engines; trainers staging on the GPU);
    host1: cuda off (trainers whose CPU replica must cross tcp)."""
    c = LocalCluster(hosts=2, extra=FAST)
    for host in range(2):
        c.keys(f"host{host}")
    bounce = {"tcp-bounce-bytes": str(BOUNCE)}
    c.start_daemon(0, coordinator=True, flags={"cuda": "on", **bounce})
    c.start_daemon(1, flags={"cuda": "off", **bounce})
    c.wait_joined()
    yield c
    codes = c.stop()
    assert codes == [0, 0], f"daemons exited with {codes}; logs in {c.workdir}"


def moved(c: LocalCluster, host: int, transport: str, stat: str = "bytes_sent") -> int:
    if host >= len(c.daemons):
        return 0
    return int(fetch(c.daemons[host].socket)["transports"].get(transport, {}).get(stat, 0))


def sync(
    c: LocalCluster,
    job: str,
    dest: str,
    staging: str,
    trainer_host: int,
    zero_copy: bool = False,
    staging_buckets: int = 4,
    direct: bool = False,
    slot_events: bool = True,
    versions: tuple[int, ...] = (1, 2),
    slot_counters: bool = True,
    abort_at: int = 0,
    gate_copies: bool = True,
) -> dict[str, Any]:
    """`abort_at` > 0: version `abort_at` is aborted by rank 0 once its packing stream
    waits for a slot on the GPU (its counter), and must fail (not hang); the versions after
    it must land bitwise."""
    tg, eg = ([0, 0], [0, 0]) if direct else placement()
    engines, received = [], []
    for r in range(2):
        lay = EngineLayout(tp_size=2, tp_rank=r, model=CFG, dest_dtype=dest)
        dev = device(eg[r])
        # one allocation per tensor, as an engine's parameters are: one region each
        tensors = {
            t.name: torch.zeros(t.shape, dtype=TORCH[t.dtype], device=dev)
            for t in engine_tensors(CFG, lay)
        }
        eng = Engine(r, 2, socket=c.daemons[0].socket, job=job, timeout_s=120)
        eng.register(tensors, layout=lay)
        engines.append(eng)
        received.append(tensors)
    trainers: list[tuple[Trainer, dict[str, torch.Tensor]]] = []
    before = {
        "cuda": moved(c, 0, "cuda"),
        "in_place": moved(c, 0, "cuda", "in_place_writes"),
        "tcp0": moved(c, 0, "tcp"),
        "tcp1": moved(c, 1, "tcp"),
    }
    nbytes, staged, held, slots, writes = 0, 0, 0, 0, 0
    waited = True  # with a ring: every bucket packed only after its slot's last one landed
    by_event, by_landing, by_counter, reuses, issued, aborted = 0, 0, 0, 0, 0, 0
    gated, published = 0, 0
    landed_notes: list[BucketsLanded] = []  # the daemon's slot messages to the trainers
    try:
        for version in versions:
            hf = random_hf(CFG, seed=version)
            if not trainers:
                for r in range(2):
                    dev = device(tg[r])
                    step = {n: -(-t.shape[0] // 2) for n, t in hf.items()}
                    mine = {
                        n: t[r * step[n] : (r + 1) * step[n]].to(dev).contiguous()
                        for n, t in hf.items()
                    }
                    tr = Trainer(
                        r,
                        2,
                        socket=c.daemons[trainer_host].socket,
                        job=job,
                        timeout_s=120,
                        staging=staging,  # type: ignore[arg-type]
                        staging_buckets=staging_buckets,
                        direct=direct,
                        slot_events=slot_events,
                        slot_counters=slot_counters,
                        gate_copies=gate_copies,
                    )
                    tr.register(
                        mine,
                        layout=Shard(0, r, 2),
                        global_shapes={n: tuple(t.shape) for n, t in hf.items()},
                        zero_copy=zero_copy,
                    )
                    trainers.append((tr, mine))
                    notify = tr._pending.notify

                    def count(msg: Any, notify: Any = notify) -> None:
                        if isinstance(msg, BucketsLanded):
                            landed_notes.append(msg)
                        notify(msg)

                    tr._pending.notify = count  # type: ignore[method-assign]
                for tr, _ in trainers:  # every rank registered: the plan, the staging
                    staged += tr.prepare().staging_bytes
                    held += tr.staging_bytes
                    slots = max(slots, tr.ring().slots)
            for r, (_, mine) in enumerate(trainers):
                for n, t in hf.items():
                    step = -(-t.shape[0] // 2)
                    mine[n].copy_(t[r * step : (r + 1) * step])
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            errors: list[BaseException] = []
            stats: list[Any] = []

            def publish(
                tr: Trainer,
                v: int = version,
                errors: list[BaseException] = errors,
                stats: list[Any] = stats,
            ) -> None:
                try:
                    stats.append(tr.publish(v))
                except BaseException as exc:
                    errors.append(exc)

            if version == abort_at:
                _abort_once_waiting(trainers[0][0], version)
            threads = [threading.Thread(target=publish, args=(tr,)) for tr, _ in trainers]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
            assert not any(t.is_alive() for t in threads), "a publish hung"
            if version == abort_at:
                # rank 0 aborted; rank 1 failed with it, or had landed everything first
                assert all(isinstance(e, WeightwireError) for e in errors), errors
                assert any(e.code == ErrorCode.ABORTED for e in errors), errors
                for tr, _ in trainers:  # no GPU wait left behind: the streams drain
                    done = torch.cuda.Event()
                    done.record(torch.cuda.current_stream(tr._device()))
                    deadline = time.monotonic() + 30
                    while not done.query():
                        assert time.monotonic() < deadline, "the packing stream still waits"
                        time.sleep(0.01)
                aborted += 1
                for eng in engines:
                    with pytest.raises(WeightwireError):
                        eng.wait(version, 20)
                continue
            assert not errors, errors
            nbytes += sum(s.nbytes for s in stats)
            writes += sum(s.writes for s in stats)
            by_event += sum(s.slot_events for s in stats)
            by_landing += sum(s.slot_landings for s in stats)
            by_counter += sum(s.slot_counters for s in stats)
            gated += sum(s.gated for s in stats)
            published += len(stats)
            reuses += sum(max(len(s.buckets) - slots, 0) for s in stats) if slots else 0
            issued += sum(
                int(p["buckets_issued"])
                for p in fetch(c.daemons[trainer_host].socket)["publishing"]
                if p["job"] == job
            )
            if slots:
                waited = waited and all(
                    b[k].prepare_start >= b[k - slots].landed > 0
                    for b in (s.buckets for s in stats)
                    for k in range(slots, len(b))
                )
            for r, eng in enumerate(engines):
                eng.wait(version, 120)
                want = reference(CFG, hf, 2, r, 1, 128 if dest == "fp8" else None)
                assert set(want) == set(received[r])
                for n, expected in want.items():
                    got = received[r][n]
                    assert got.device == device(eg[r])
                    assert got.dtype == expected.dtype and got.shape == expected.shape, n
                    assert torch.equal(
                        got.cpu().view(torch.uint8), expected.contiguous().view(torch.uint8)
                    ), f"{job} v{version} engine rank {r}: {n} differs from the reference"
    finally:
        for tr, _ in trainers:
            tr.close()
        for eng in engines:
            eng.close()
    return {
        "bytes": nbytes,
        "staged": staged,
        "held": held,
        "slots": slots,
        "waited": waited,
        "by_event": by_event,
        "by_landing": by_landing,
        "by_counter": by_counter,
        "gated": gated,  # publishes whose copies waited on the GPU for the pack counter
        "landed_notes": len(landed_notes),
        "published": published,
        "aborted": aborted,
        "reuses": reuses,
        "issued": issued,
        "cuda": moved(c, 0, "cuda") - before["cuda"],
        "in_place": moved(c, 0, "cuda", "in_place_writes") - before["in_place"],
        "writes": writes,
        "tcp0": moved(c, 0, "tcp") - before["tcp0"],
        "tcp1": moved(c, 1, "tcp") - before["tcp1"],
    }


@pytest.mark.parametrize("dest", ["", "fp8"])
def test_gpu_staging_through_cuda_ipc(gpu_cluster: LocalCluster, dest: str) -> None:
    got = sync(gpu_cluster, f"gpu-staging-{dest or 'bf16'}", dest, "gpu", trainer_host=0)
    assert got["bytes"] > 0
    assert got["cuda"] == got["bytes"], got  # every byte GPU to GPU by the copy engines
    assert got["tcp0"] == 0, got


@pytest.fixture(scope="module")
def small_buckets() -> Iterator[LocalCluster]:
    """One daemon, cuda on, planning buckets of 256 KiB: more buckets than ring slots."""
    yield from serve(
        LocalCluster(hosts=1, extra={**FAST, "bucket-bytes": str(256 << 10), "cuda": "on"})
    )


@pytest.mark.parametrize("dest", ["", "fp8"])
def test_gpu_staging_ring_through_cuda_ipc(small_buckets: LocalCluster, dest: str) -> None:
    """GPU staging as a ring of 2 bucket slots, slots freed by landings (no GPU events):
    every bucket packed into its slot only once the slot's last bucket landed (the copy
    engines done reading it), all bitwise, and less staging memory than the whole send."""
    job = f"gpu-ring-{dest or 'bf16'}"
    got = sync(
        small_buckets,
        job,
        dest,
        "gpu",
        trainer_host=0,
        staging_buckets=2,
        slot_events=False,
        slot_counters=False,
    )
    assert got["slots"] == 2 and got["waited"], got
    assert got["held"] < got["staged"], got
    assert got["cuda"] == got["bytes"] > 0, got
    assert got["by_event"] == 0 and got["by_landing"] == got["reuses"] > 0, got
    assert got["issued"] == 0, got


@pytest.mark.parametrize("dest", ["", "fp8"])
def test_gpu_staging_ring_slots_fenced_by_ipc_events(
    small_buckets: LocalCluster, dest: str
) -> None:
    """A ring of 2 slots whose buckets all go by cuda copies: the daemon reports each
    bucket's copies issued with its CUDA IPC events, and the trainer's packing stream waits
    on them instead of its thread waiting for the landing. Four versions, all bitwise (the
    GPU ordering alone keeps a slot from being overwritten while it is copied out)."""
    job = f"gpu-ring-events-{dest or 'bf16'}"
    got = sync(
        small_buckets,
        job,
        dest,
        "gpu",
        trainer_host=0,
        staging_buckets=2,
        slot_events=True,
        versions=(1, 2, 3, 4),
        slot_counters=False,
    )
    assert got["slots"] == 2 and got["held"] < got["staged"], got
    assert got["cuda"] == got["bytes"] > 0, got
    assert got["by_event"] + got["by_landing"] == got["reuses"] > 0, got
    assert got["by_event"] > 0 and got["issued"] > 0, got  # the event path was taken


@pytest.mark.parametrize("slots", [2, 4])
@pytest.mark.parametrize("dest", ["", "fp8"])
def test_gpu_staging_ring_slots_on_gpu_counters(
    small_buckets: LocalCluster, dest: str, slots: int
) -> None:
    """A ring of 2 or 4 slots waited for on the GPU: the packing stream waits on each slot's
    counter, which the daemon writes right after the slot's cuda copies, and the trainer's
    thread never waits for the daemon (no BucketsIssued, no BucketsLanded). Four versions,
    all bitwise: the GPU ordering alone keeps a slot from being packed while copied out."""
    job = f"gpu-ring-counters-{dest or 'bf16'}-{slots}"
    got = sync(
        small_buckets, job, dest, "gpu", trainer_host=0, staging_buckets=slots,
        versions=(1, 2, 3, 4),
    )  # fmt: skip
    assert got["slots"] == slots and got["held"] < got["staged"], got
    assert got["cuda"] == got["bytes"] > 0, got
    assert got["by_counter"] == got["reuses"] > 0, got
    assert got["by_event"] == got["by_landing"] == 0, got
    assert got["issued"] > 0, got  # counters written on the GPU after the copies
    assert got["gated"] == got["published"] == 8, got  # posted before packed (the default)


@pytest.mark.parametrize("gate", [True, False])
def test_gpu_ring_counters_released_when_a_version_fails(
    small_buckets: LocalCluster, gate: bool
) -> None:
    """Version 2 is aborted while rank 0's packing stream waits on a slot counter: both
    ranks' publishes fail with ABORTED (none hangs), their GPU streams drain (the counters
    were released), the engines fail version 2, and versions 3 and 4 land bitwise. With
    the pack counter (`gate`), the daemon's copies of buckets posted before their packing
    ran wait on the GPU meanwhile: they end too."""
    got = sync(
        small_buckets, f"gpu-ring-counters-abort-{gate}", "", "gpu", trainer_host=0,
        staging_buckets=2, versions=(1, 2, 3, 4), abort_at=2, gate_copies=gate,
    )  # fmt: skip
    assert got["aborted"] == 1, got
    assert got["by_counter"] > 0 and got["slots"] == 2, got
    assert got["gated"] == (got["published"] if gate else 0), got


@pytest.mark.parametrize("slots", [0])  # rings of 2 and 4: the slot counter tests above
@pytest.mark.parametrize("dest", ["", "fp8"])
def test_gpu_buckets_posted_before_packed(
    small_buckets: LocalCluster, dest: str, slots: int
) -> None:
    """The whole send with the pack counter: every bucket is posted as soon as its packing
    is queued, and the daemon's copies wait on the GPU for the packing stream's counter
    (rings of 2 and 4 the same, their packing waiting for the slot counters the daemon
    writes after the copies: no host in the loop, test above). Four versions, bitwise."""
    job = f"gpu-gated-{dest or 'bf16'}-{slots}"
    got = sync(
        small_buckets, job, dest, "gpu", trainer_host=0, staging_buckets=slots,
        versions=(1, 2, 3, 4),
    )  # fmt: skip
    assert got["gated"] == got["published"] == 8, got
    assert got["cuda"] == got["bytes"] > 0, got
    assert got["slots"] == slots, got
    if slots:
        assert got["by_counter"] == got["reuses"] > 0, got
        assert got["by_event"] == got["by_landing"] == 0, got


def test_gpu_ring_counters_without_the_pack_counter(small_buckets: LocalCluster) -> None:
    """`gate_copies=False`: the older way (each bucket posted once its packing is done, as
    its CUDA event tells), still bitwise with slot counters."""
    got = sync(
        small_buckets, "gpu-ring-counters-ungated", "", "gpu", trainer_host=0,
        staging_buckets=2, versions=(1, 2, 3), gate_copies=False,
    )  # fmt: skip
    assert got["gated"] == 0 and got["by_counter"] == got["reuses"] > 0, got
    assert got["cuda"] == got["bytes"] > 0, got


def _abort_once_waiting(tr: Trainer, version: int) -> None:
    """Rank `tr` aborts `version` (through its own connection, as a failing trainer does)
    right after its packing stream first waits on a slot counter: the wait is queued, and
    the daemon fails the version, so the counters must be released."""
    waits = tr._slots
    original = waits.wait

    def wait(counters: torch.Tensor, slot: int, bucket: int) -> None:
        original(counters, slot, bucket)
        waits.wait = original  # type: ignore[method-assign]
        # the version's last number: only a release can end this wait now
        original(counters, slot, len(tr.plan().buckets) - 1)
        tr._abort(version, "aborted by the test while the GPU waits on a slot counter")

    waits.wait = wait  # type: ignore[method-assign]


@pytest.mark.parametrize("dest", ["", "fp8"])
def test_gpu_colocated_packs_in_place(gpu_cluster: LocalCluster, dest: str) -> None:
    """Trainers and engines on GPU 0, `direct=True`: every bucket is packed straight into
    the engines' memory (this process's own allocations), nothing is copied, every write's
    immediate is still delivered (the engines complete), all bitwise, two versions."""
    got = sync(gpu_cluster, f"colocated-{dest or 'bf16'}", dest, "gpu", trainer_host=0, direct=True)
    assert got["bytes"] > 0, got
    assert got["cuda"] == 0, got  # no copy: packing was the transfer
    assert got["in_place"] == got["writes"] > 0, got


@pytest.mark.parametrize("dest", ["", "fp8"])
def test_gpu_colocated_in_place_waits_for_no_slot(small_buckets: LocalCluster, dest: str) -> None:
    """Packed in place, a bucket uses no staging slot: with more buckets than ring slots,
    the trainer never waits for a slot (no landing, no event), so the GPU gets every
    bucket's packing queued at once; all bitwise, three versions."""
    job = f"colocated-noslot-{dest or 'bf16'}"
    got = sync(small_buckets, job, dest, "gpu", trainer_host=0, staging_buckets=2,
               direct=True, versions=(1, 2, 3))  # fmt: skip
    assert got["slots"] == 2 and got["reuses"] > 0, got
    assert got["by_event"] == got["by_landing"] == 0, got
    assert got["cuda"] == 0 and got["in_place"] == got["writes"] > 0, got
    assert got["landed_notes"] == 0, got  # no message per bucket while the trainer packs


def test_gpu_zero_copy_sources(gpu_cluster: LocalCluster) -> None:
    """Trainers' own GPU tensors registered zero-copy: their contiguous parts go straight
    from the tensors' memory (less staging than bytes), the rest is packed, all bitwise."""
    got = sync(gpu_cluster, "gpu-zero-copy", "", "gpu", trainer_host=0, zero_copy=True)
    plain = sync(gpu_cluster, "gpu-zero-copy-off", "", "gpu", trainer_host=0)
    assert got["cuda"] == got["bytes"] > 0, got
    assert got["staged"] < plain["staged"], (got, plain)


def test_pinned_replica_into_engine_gpus_by_cuda(gpu_cluster: LocalCluster) -> None:
    got = sync(gpu_cluster, "pinned-replica-cuda", "", "cpu", trainer_host=0)
    assert got["cuda"] == got["bytes"] > 0, got


@pytest.mark.parametrize("dest", ["", "fp8"])
def test_cpu_replica_over_tcp_into_gpu(gpu_cluster: LocalCluster, dest: str) -> None:
    got = sync(gpu_cluster, f"replica-tcp-{dest or 'bf16'}", dest, "cpu", trainer_host=1)
    assert got["tcp1"] == got["bytes"] > 0, got  # the trainers' daemon sent it all over tcp
    assert got["cuda"] == 0, got
    # the engines' daemon landed it through bounces of at most tcp_bounce_bytes (the
    # pieces of writes larger than that: tests/test_tcp_gpu.py)
    largest = moved(gpu_cluster, 0, "tcp", "bounce_largest_bytes")
    assert 0 < largest <= BOUNCE, largest


def test_release_parameters_frees_an_offloaded_modules_gpu_memory(
    gpu_cluster: LocalCluster,
) -> None:
    """An offload right after a publish (`model.to("cpu")`, as verl's FSDP param offload):
    after `release_parameters()` the parameters' GPU memory is free at once (the rank's
    registry and its packs of the last publish held it), and after the reload the next
    publish lands bitwise."""
    dev = device(0)
    model = torch.nn.Linear(2048, 2048, bias=False).to(dev)  # 16 MiB
    sock = gpu_cluster.daemons[0].socket
    job = "gpu-release-parameters"
    eng = Engine(0, 1, socket=sock, job=job, timeout_s=60, device=dev.index)
    dst = torch.zeros(2048, 2048, device=dev)
    eng.register({"weight": dst})
    try:
        with Trainer(0, 1, socket=sock, job=job, timeout_s=60, device=dev.index) as tr:
            tr.register_module(model)
            for version in (1, 2):
                tr.publish(version)
                eng.wait(version)
                assert torch.equal(dst, model.weight.detach())
                tr.release_parameters()
                torch.cuda.synchronize(dev)
                before = torch.cuda.memory_allocated(dev)
                model.to("cpu")
                freed = before - torch.cuda.memory_allocated(dev)
                assert freed >= model.weight.nbytes, (version, before, freed)
                model.to(dev)
                with torch.no_grad():
                    model.weight.mul_(-2)  # the optimizer step after the rollout
    finally:
        eng.close()
