"""A full region filesystem is a clean `RegionError`, never SIGBUS.

Shared regions live in a tmpfs (/dev/shm by default; `region_dir` here points at an 8 MiB
tmpfs mounted for the test). Their pages are reserved when they are made, so a rank whose
region does not fit learns it from an error naming the path, the size and the space left,
and the daemon, which maps what ranks register, never touches a page it could not have.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.connection import DaemonConnection
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.memory.hostmem import create_shared, free_bytes
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, RegionError
from weightwire.protocol.local import Hello, RegisterRegion

from .conftest import FAST, NETNS, serve

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
MiB = 1 << 20


@pytest.fixture(scope="module")
def small_shm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("shm")
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=1777", "weightwire-test", str(d)], check=True
    )
    yield str(d)
    subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture(scope="module")
def shm_cluster(small_shm: str) -> Iterator[LocalCluster]:
    yield from serve(
        LocalCluster(hosts=2, use_netns=NETNS, extra={**FAST, "region-dir": small_shm})
    )


def test_a_region_that_does_not_fit_is_a_region_error(small_shm: str) -> None:
    held = create_shared(5 * MiB, purpose="test", directory=small_shm)
    try:
        free = free_bytes(small_shm)
        with pytest.raises(RegionError) as err:
            create_shared(5 * MiB, purpose="test", directory=small_shm)
        assert err.value.code is ErrorCode.NO_SPACE
        msg = err.value.message
        assert f"{small_shm}/weightwire.{os.getpid()}.test." in msg, msg
        assert f"{5 * MiB} bytes needed, {free} bytes free" in msg, msg
        assert os.listdir(small_shm) == [os.path.basename(held.path)]  # nothing left behind
        held.view[:] = b"\x5a" * held.length  # what was reserved is all there
        assert held.view[-1] == 0x5A
    finally:
        held.unlink()
        assert held.close()


ENGINE_RANK = """
import json, sys, torch
from weightwire.client import Engine
from weightwire.protocol.errors import WeightwireError
eng = Engine(0, 1, socket=sys.argv[1], job="too-big", timeout_s=10)
try:
    eng.register({"w": torch.ones(3 << 20)})  # 12 MiB of float32, into an 8 MiB tmpfs
    print(json.dumps({"registered": True}), flush=True)
except WeightwireError as exc:
    print(json.dumps({"error": type(exc).__name__, "code": exc.code.value,
                      "message": exc.message}), flush=True)
eng.close()
"""


def test_an_engine_rank_whose_weights_do_not_fit_gets_a_region_error(
    shm_cluster: LocalCluster, small_shm: str
) -> None:
    """A real engine rank process: before pages were reserved, copying its weights into
    the sparse region file killed it with SIGBUS."""
    p = subprocess.run(
        [sys.executable, "-c", ENGINE_RANK, shm_cluster.daemons[1].socket],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["error"] == "RegionError" and out["code"] == "no_space", out
    assert small_shm in out["message"] and f"{12 * MiB} bytes needed" in out["message"], out
    assert not [n for n in os.listdir(small_shm) if ".engine-r0." in n]
    healthy_sync(shm_cluster, "after-too-big")


def test_the_daemon_reserves_a_sparse_region_file_or_refuses_it(
    shm_cluster: LocalCluster, small_shm: str
) -> None:
    """A rank registers a sparse file larger than the tmpfs (made by hand, as a client
    that does not reserve its pages would): the daemon refuses it with a RegionError
    naming the file instead of dying of SIGBUS when a write lands, and keeps serving."""
    path = Path(small_shm) / f"weightwire.{os.getpid()}.engine-r0.sparse"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
    try:
        os.ftruncate(fd, 16 * MiB)
        with DaemonConnection(shm_cluster.daemons[1].socket) as raw:
            raw.request(
                Hello(protocol=PROTOCOL_VERSION, role="engine", rank=0, world_size=1, job="sp")
            )
            with pytest.raises(RegionError) as err:
                raw.request(RegisterRegion(path=str(path), length=16 * MiB))
        assert err.value.code is ErrorCode.NO_SPACE
        assert str(path) in err.value.message and f"{16 * MiB} bytes needed" in err.value.message
    finally:
        os.close(fd)
        path.unlink()
    assert fetch(shm_cluster.daemons[1].socket)["node"] == "host1"
    healthy_sync(shm_cluster, "after-sparse")


def test_a_staging_region_that_does_not_fit_is_a_region_error(
    shm_cluster: LocalCluster, small_shm: str
) -> None:
    """A trainer rank packing in host memory: its staging region does not fit while
    another file fills the tmpfs; once there is room, the same rank publishes bitwise."""
    w = torch.arange(768 << 10, dtype=torch.float32)  # 3 MiB
    dst = torch.zeros_like(w)
    eng = Engine(0, 1, socket=shm_cluster.daemons[1].socket, job="staging-full", timeout_s=20)
    tr = Trainer(0, 1, socket=shm_cluster.daemons[0].socket, job="staging-full", timeout_s=20)
    filler = None
    try:
        eng.register({"w": dst})  # 3 MiB of the 8
        tr.register({"w": w})
        filler = create_shared(
            free_bytes(small_shm) - 1 * MiB, purpose="filler", directory=small_shm
        )
        with pytest.raises(RegionError) as err:
            tr.prepare(timeout_s=20)
        assert err.value.code is ErrorCode.NO_SPACE
        assert ".staging-r0." in err.value.message and "bytes needed" in err.value.message
        filler.unlink()
        filler.close()
        filler = None
        tr.publish(1)
        eng.wait(1)
        assert torch.equal(dst, w)
    finally:
        if filler is not None:
            filler.unlink()
            filler.close()
        tr.close()
        eng.close()


def healthy_sync(cluster: LocalCluster, job: str) -> None:
    """The daemons still move a version end to end, bitwise, through regions in the tmpfs."""
    w = torch.arange(64 * 1024, dtype=torch.float32) * 3
    dst = torch.zeros_like(w)
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=20)
    eng.register({"w": dst})
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=20)
    tr.register({"w": w})
    try:
        tr.publish(1)
        eng.wait(1)
        assert torch.equal(dst, w)
    finally:
        tr.close()
        eng.close()


def test_delta_regions_live_in_the_region_directory(
    shm_cluster: LocalCluster, small_shm: str
) -> None:
    """A daemon whose regions live elsewhere than /dev/shm (`region_dir`): an engine rank's
    host delta area was made in /dev/shm all the same, and the daemon refused it ("not in
    <region_dir>"), so no engine with a delta area could register there. Now the area and
    the trainer's delta-out region are made where the daemon maps regions from, deltas flow
    bitwise; an area that does not fit is a RegionError naming the file."""
    w = torch.arange(256 << 10, dtype=torch.float32)  # 1 MiB
    dst = torch.zeros_like(w)
    job = "delta-region-dir"
    eng = Engine(0, 1, socket=shm_cluster.daemons[1].socket, job=job, timeout_s=20, delta_area=0.5)
    tr = Trainer(0, 1, socket=shm_cluster.daemons[0].socket, job=job, timeout_s=20, delta="on")
    try:
        eng.register({"w": dst})
        tr.register({"w": w})
        names = os.listdir(small_shm)
        assert [n for n in names if ".delta-r0." in n], names
        for version in range(3):
            w[version::97] += 1
            stats = tr.publish(version)
            eng.wait(version)
            assert torch.equal(dst, w)
        assert stats.delta_bytes > 0 and eng.delta is not None and eng.delta.held == 2
    finally:
        tr.close()
        eng.close()
    big = Engine(
        0, 1, socket=shm_cluster.daemons[1].socket, job=job + "-2", timeout_s=20, delta_area=4.0
    )
    try:
        with pytest.raises(RegionError) as err:
            big.register({"w": torch.zeros(512 << 10)})  # 2 MiB, and an area of 8 MiB
        assert err.value.code is ErrorCode.NO_SPACE and ".delta-r0." in err.value.message
        assert small_shm in err.value.message
    finally:
        big.close()
    healthy_sync(shm_cluster, "after-delta-region-dir")


def _free(small_shm: str, at_least: int) -> int:
    """The tmpfs's free bytes once they reach `at_least` (a closed rank's threads let go of
    it within moments), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        gc.collect()
        free = free_bytes(small_shm)
        if free >= at_least or time.monotonic() > deadline:
            return free
        time.sleep(0.05)


def test_closed_ranks_give_their_region_memory_back(
    shm_cluster: LocalCluster, small_shm: str
) -> None:
    """Ranks made and closed one after another in one process (a bench's runs, an engine
    made again after a replan): a closed engine kept the descriptors of its weights'
    region and its delta area open (and a trainer those of `allocate`'s sources), so their
    pages stayed allocated in the tmpfs until the process exited, and in this 8 MiB one
    the second engine found no room. Now a closed rank's files go back as soon as the
    caller's tensors on them go; tensors kept past `close` still hold their bytes."""
    free0 = _free(small_shm, 8 * MiB)
    assert free0 == 8 * MiB, "the tests before left memory in the tmpfs"
    kept: dict[str, torch.Tensor] = {}
    for i in range(4):
        job = f"reuse-{i}"
        eng = Engine(0, 1, socket=shm_cluster.daemons[1].socket, job=job, timeout_s=20,
                     delta_area=0.5)  # fmt: skip
        tr = Trainer(0, 1, socket=shm_cluster.daemons[0].socket, job=job, timeout_s=20,
                     delta="on")  # fmt: skip
        try:
            src = tr.allocate({"w": ((256 << 10,), torch.float32)})["w"]  # 1 MiB, zero-copy
            src.copy_(torch.arange(256 << 10, dtype=torch.float32) + i)
            dst = torch.zeros_like(src)
            eng.register({"w": dst})  # 1 MiB of weights, 1 MiB of delta area
            tr.register({"w": src})
            for version in range(2):
                src[version::31] += 1
                tr.publish(version)
                eng.wait(version)
                assert torch.equal(dst, src)
            expected = src.clone()
        finally:
            tr.close()
            eng.close()
        assert torch.equal(dst, expected)  # the engine's weights outlive its close
        if i == 0:
            kept["dst"], kept["expected"] = dst, expected
        del src, dst, tr, eng
        want = free0 - 1 * MiB  # all but the first engine's weights, still in use
        assert _free(small_shm, want) >= want, "a closed rank kept its files"
    assert torch.equal(kept["dst"], kept["expected"])  # still mapped, three ranks later
    kept.clear()
    assert _free(small_shm, free0) >= free0
    healthy_sync(shm_cluster, "after-reuse")
