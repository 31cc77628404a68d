"""Two processes of one host: a cuda transport writing into GPU memory another process
owns, through its CUDA IPC handle, and letting it go once its plans no longer name it.

- The transport alone, the memory owned by a child process (as an engine rank's memory
  is, registered with another daemon): a write lands bitwise; a write issued just before
  the region is let go lands whole (the mapping is closed only once it is done) and is
  reported peer_lost; the mapping is then closed (`ipc_mappings` 0); a write afterwards
  is refused peer_lost and nothing of it lands; named again, the region takes writes.
- Two daemons with cuda on, an engine rank on one, a trainer rank on the other (both on
  GPU 0): a version lands bitwise through the trainer daemon's mapping of the engine's
  memory; the engine rank leaves, and the trainer's daemon closes that mapping; a new
  engine rank gets the next version bitwise. Or the engine rank releases its memory: the
  trainer's daemon closes its mapping too, a version meanwhile fails, and after the
  resume the next lands bitwise.

All fail on the old code: the transport had no `peer_regions`, and a daemon never closed
its mapping of another's memory (its cuda status had no `ipc_mappings` either).
Needs a GPU: run by scripts/gpu-suite.sh (SUITE_TEST_FILES=tests/test_cuda_remote_gpu.py);
skipped elsewhere, saying why. The bookkeeping without a GPU: tests/test_cuda_remote.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightwire.harness.localcluster import LocalCluster
from weightwire.memory.cudadrv import available, driver
from weightwire.protocol.errors import ErrorCode, PeerLostError, WeightwireError
from weightwire.protocol.regions import (
    CudaEndpoint,
    CudaKey,
    RegionDescriptor,
    RegionKeys,
    TransportEndpoints,
)
from weightwire.transport.base import LocalRegion, WriteRequest

OK, WHY = available()
if OK:
    import torch

    from weightwire.client import Engine, Trainer
    from weightwire.client.status import fetch

    from .conftest import FAST

    if not torch.cuda.is_available():
        OK, WHY = False, "torch sees no CUDA device (a CPU build of torch?)"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")]

MiB = 1 << 20
N = 64 * MiB

OWNER = r"""
import ctypes, json, sys
from weightwire.memory.cudadrv import driver
n = int(sys.argv[1])
drv = driver()
drv.use(0)
ptr = drv.alloc(n)
base, _ = drv.address_range(ptr)
s = drv.stream()
zeros = ctypes.create_string_buffer(n)
drv.copy_async(ptr, ctypes.addressof(zeros), n, s)
drv.synchronize(s)
print(json.dumps({"handle": drv.ipc_handle(base).hex(), "offset": ptr - base,
                  "uuid": drv.devices[0].uuid}), flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "read":
        host = ctypes.create_string_buffer(n)
        drv.copy_async(ctypes.addressof(host), ptr, n, s)
        drv.synchronize(s)
        with open(arg, "wb") as f:
            f.write(host.raw)
    elif cmd == "free":
        drv.free(ptr)
    print("ok", flush=True)
"""


class Owner:
    """A child process owning `N` bytes of GPU 0 (zeroed), exported by its IPC handle."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OWNER, str(N)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        info = json.loads(self.proc.stdout.readline())
        self.handle = bytes.fromhex(info["handle"])
        self.offset, self.uuid = int(info["offset"]), str(info["uuid"])

    def _ask(self, line: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def read(self) -> bytes:
        path = self.dir / "owner.bin"
        self._ask(f"read {path}")
        return path.read_bytes()

    def close(self) -> int:
        self._ask("free")
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(30)


@pytest.fixture
def owner() -> Iterator[Owner]:
    with tempfile.TemporaryDirectory() as d:
        o = Owner(Path(d))
        try:
            yield o
        finally:
            if o.proc.poll() is None:
                o.proc.kill()
                o.proc.wait(10)


def _pattern(seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(N)


@pytest.mark.parametrize("src_device", ["same", "other"])
def test_a_region_let_go_is_refused_and_its_mapping_closed_once_drained(
    owner: Owner, src_device: str
) -> None:
    from weightwire.transport.cuda import CudaTransport

    drv = driver()
    device = len(drv.devices) - 1 if src_device == "other" else 0
    if src_device == "other" and device == 0:
        pytest.skip("one GPU: the copy from another GPU (a peer mapping) needs two")

    async def body() -> None:
        t = CudaTransport("writer")
        await t.start(lambda imm, source: None)
        drv.use(device)
        src_ptr = drv.alloc(N)
        stream = drv.stream()

        def fill(data: bytes) -> None:
            host = ctypes.create_string_buffer(data, N)
            drv.use(device)
            drv.copy_async(src_ptr, ctypes.addressof(host), N, stream)
            drv.synchronize(stream)

        try:
            await t.connect("owner", TransportEndpoints(cuda=CudaEndpoint(host_id=t.host)))
            src = LocalRegion(id=1, kind="gpu", length=N, address=src_ptr, device=device)
            key = CudaKey(
                host_id=t.host, device_uuid=owner.uuid, ipc_handle=owner.handle, offset=owner.offset
            )
            dst = RegionDescriptor(
                id=5, node="owner", kind="gpu", length=N, keys=RegionKeys(cuda=key)
            )

            async def write() -> BaseException | None:
                [res] = await t.post(t.prepare([WriteRequest(src, 0, dst, 0, N, None)]), [None])
                return res

            t.peer_regions([dst])  # the plan names it
            fill(_pattern(1))
            assert await write() is None
            assert owner.read() == _pattern(1)
            assert t.stats()["ipc_mappings"] >= 1

            # issued, then let go before it is seen finished: it lands whole (the mapping
            # waits for it), and is reported peer_lost (no immediate, never "landed")
            fill(_pattern(2))
            task = asyncio.create_task(write())
            await asyncio.sleep(0)  # the post is issued on its lane, in this task's step
            t.peer_regions([])  # the plan was withdrawn: the owner's rank left
            res = await asyncio.wait_for(task, 30)
            assert isinstance(res, PeerLostError) and res.code is ErrorCode.PEER_LOST, res
            deadline = time.monotonic() + 15
            while t.stats()["ipc_mappings"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert t.stats()["ipc_mappings"] == 0  # closed once the copy was done
            assert owner.read() == _pattern(2)

            fill(_pattern(3))
            res = await write()  # refused before the handle is opened again
            assert isinstance(res, PeerLostError) and "region 5 is gone" in res.message, res
            assert t.stats()["ipc_mappings"] == 0
            assert owner.read() == _pattern(2)  # nothing of it landed

            t.peer_regions([dst])  # a plan names it again
            assert await write() is None
            assert owner.read() == _pattern(3)
            t.peer_regions([])
            deadline = time.monotonic() + 15
            while t.stats()["ipc_mappings"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert t.stats()["ipc_mappings"] == 0
        finally:
            await t.close()
            drv.use(device)
            drv.free(src_ptr)

    asyncio.run(asyncio.wait_for(body(), 120))
    assert owner.close() == 0  # the owner frees its memory, nobody maps it


@pytest.fixture(scope="module")
def two_daemons() -> Iterator[LocalCluster]:
    """Two daemons of this host, cuda on in both (host0 coordinates)."""
    c = LocalCluster(hosts=2, extra=FAST)
    for host in range(2):
        c.keys(f"host{host}")
    c.start_daemon(0, coordinator=True, flags={"cuda": "on"})
    c.start_daemon(1, flags={"cuda": "on"})
    c.wait_joined()
    yield c
    codes = c.stop()
    assert codes == [0, 0], f"daemons exited with {codes}; logs in {c.workdir}"


def cuda_stats(c: LocalCluster, host: int) -> dict[str, int]:
    return dict(fetch(c.daemons[host].socket)["transports"]["cuda"])


def mappings_become(c: LocalCluster, host: int, want: int, timeout_s: float = 20.0) -> int:
    """`ipc_mappings` of `host`'s cuda transport once it is `want` (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while (got := cuda_stats(c, host)["ipc_mappings"]) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


@contextlib.contextmanager
def closing_all() -> Iterator[list[Engine | Trainer]]:
    """The clients put in the list are closed at the end, whatever happens."""
    clients: list[Engine | Trainer] = []
    try:
        yield clients
    finally:
        for client in clients:
            client.close()


def published(
    c: LocalCluster, job: str, seed: int, clients: list[Engine | Trainer]
) -> tuple[Engine, Trainer, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An engine rank on host0 and a trainer rank on host1 (both on GPU 0), version 1
    landed bitwise through host1's cuda transport, by its mapping of the engine's memory."""
    dst = {"w": torch.zeros(4 * MiB, device="cuda:0")}  # its own allocation: CUDA IPC
    g = torch.Generator(device="cuda").manual_seed(seed)
    src = {"w": torch.randn(4 * MiB, device="cuda:0", generator=g)}
    eng = Engine(0, 1, socket=c.daemons[0].socket, job=job, timeout_s=60, device=0)
    clients.append(eng)
    eng.register(dst)
    tr = Trainer(0, 1, socket=c.daemons[1].socket, job=job, timeout_s=60, device=0)
    clients.append(tr)
    tr.register(src)
    sent = cuda_stats(c, 1)["bytes_sent"]
    tr.publish(1)
    eng.wait(1, timeout_s=60)
    assert torch.equal(dst["w"], src["w"])
    assert cuda_stats(c, 1)["bytes_sent"] > sent  # the trainer's daemon copied it by cuda
    assert cuda_stats(c, 1)["ipc_mappings"] >= 1  # through its mapping of the engine's memory
    return eng, tr, dst, src


def test_two_daemons_the_engine_leaves_and_the_other_daemon_closes_its_mapping(
    two_daemons: LocalCluster,
) -> None:
    c = two_daemons
    with closing_all() as clients:
        eng, tr, _, src = published(c, "leaves", 7, clients)
        eng.close()  # the engine rank leaves: its daemon removes (and unmaps) its region
        clients.remove(eng)
        assert mappings_become(c, 1, 0) == 0  # the trainer's daemon let it go too

        dst2 = {"w": torch.zeros(4 * MiB, device="cuda:0")}  # a new engine rank
        eng2 = Engine(0, 1, socket=c.daemons[0].socket, job="leaves", timeout_s=60, device=0)
        clients.append(eng2)
        eng2.register(dst2)
        src["w"].mul_(3)
        tr.publish(2)  # waits for the next plan
        eng2.wait(2, timeout_s=60)
        assert torch.equal(dst2["w"], src["w"])
        assert cuda_stats(c, 1)["ipc_mappings"] >= 1
    assert mappings_become(c, 1, 0) == 0


def published_again(tr: Trainer, first: int, attempts: int = 40) -> int:
    """The first version from `first` on that publishes, through the retryable failures of
    a plan being remade (a version begun on the plan before it fails plan_changed)."""
    for v in range(first, first + attempts):
        try:
            tr.publish(v)
            return v
        except WeightwireError as exc:
            if exc.code not in (ErrorCode.PLAN_CHANGED, ErrorCode.NOT_READY):
                raise
            time.sleep(0.25)
    raise AssertionError(f"no version from {first} published in {attempts} attempts")


def test_two_daemons_the_engine_releases_and_the_other_daemon_lets_go_until_resumed(
    two_daemons: LocalCluster,
) -> None:
    """The release is advertised without the region's CUDA key: the job is planned again
    and the trainer's daemon closes its mapping (which kept the memory allocated); a
    version meanwhile fails, none reported complete; after the resume one lands bitwise."""
    c = two_daemons
    with closing_all() as clients:
        eng, tr, dst, src = published(c, "releases", 8, clients)
        eng.release_gpu_memory()
        assert mappings_become(c, 1, 0) == 0
        with pytest.raises(WeightwireError) as err:
            tr.publish(2)
        print(json.dumps({"published_while_released": err.value.code.value}))
        dst["w"].zero_()
        eng.resume_gpu_memory()  # advertised with its new CUDA key: planned again
        src["w"].mul_(5)
        torch.cuda.synchronize()
        v = published_again(tr, 3)
        eng.wait(v, timeout_s=60)
        assert torch.equal(dst["w"], src["w"])
        assert cuda_stats(c, 1)["ipc_mappings"] >= 1
