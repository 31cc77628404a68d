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
  engine rank gets the next version bitwise.

Both fail on the old code: no `peer_regions` (the daemon never closed its mapping).
Needs a GPU: run by scripts/gpu-suite.sh (SUITE_TEST_FILES=tests/test_cuda_remote_gpu.py);
skipped elsewhere, saying why. The bookkeeping without a GPU: tests/test_cuda_remote.py.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightwire.memory.cudadrv import available, driver
from weightwire.protocol.errors import ErrorCode, PeerLostError
from weightwire.protocol.regions import (
    CudaEndpoint,
    CudaKey,
    RegionDescriptor,
    RegionKeys,
    TransportEndpoints,
)
from weightwire.transport.base import LocalRegion, WriteRequest

OK, WHY = available()
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


def test_two_daemons_the_engine_leaves_and_the_other_daemon_closes_its_mapping() -> None:
    import torch

    from weightwire.client import Engine, Trainer
    from weightwire.client.status import fetch
    from weightwire.harness.localcluster import LocalCluster

    from .conftest import FAST

    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device (a CPU build of torch?)")
    c = LocalCluster(hosts=2, extra=FAST)
    for host in range(2):
        c.keys(f"host{host}")
    c.start_daemon(0, coordinator=True, flags={"cuda": "on"})
    c.start_daemon(1, flags={"cuda": "on"})
    c.wait_joined()

    def cuda_stats(host: int) -> dict[str, int]:
        return dict(fetch(c.daemons[host].socket)["transports"]["cuda"])

    def mappings_become(host: int, want: int, timeout_s: float = 20.0) -> int:
        deadline = time.monotonic() + timeout_s
        while (got := cuda_stats(host)["ipc_mappings"]) != want and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    clients: list[Engine | Trainer] = []
    try:
        g = torch.Generator(device="cuda").manual_seed(7)
        src = {"w": torch.randn(4 * MiB, device="cuda:0", generator=g)}
        dst = {"w": torch.zeros(4 * MiB, device="cuda:0")}  # its own allocation: CUDA IPC
        eng = Engine(0, 1, socket=c.daemons[0].socket, job="remote", timeout_s=60, device=0)
        clients.append(eng)
        eng.register(dst)
        tr = Trainer(0, 1, socket=c.daemons[1].socket, job="remote", timeout_s=60, device=0)
        clients.append(tr)
        tr.register(src)
        sent = cuda_stats(1)["bytes_sent"]
        tr.publish(1)
        eng.wait(1, timeout_s=60)
        assert torch.equal(dst["w"], src["w"])
        assert cuda_stats(1)["bytes_sent"] > sent  # the trainer's daemon copied it by cuda
        assert cuda_stats(1)["ipc_mappings"] >= 1  # through its mapping of the engine's memory

        eng.close()  # the engine rank leaves: its daemon removes (and unmaps) its region
        clients.remove(eng)
        assert mappings_become(1, 0) == 0  # the trainer's daemon let it go too

        dst2 = {"w": torch.zeros(4 * MiB, device="cuda:0")}  # a new engine rank
        eng2 = Engine(0, 1, socket=c.daemons[0].socket, job="remote", timeout_s=60, device=0)
        clients.append(eng2)
        eng2.register(dst2)
        src["w"].mul_(3)
        tr.publish(2)  # waits for the next plan
        eng2.wait(2, timeout_s=60)
        assert torch.equal(dst2["w"], src["w"])
        assert cuda_stats(1)["ipc_mappings"] >= 1
    finally:
        for client in clients:
            client.close()
        codes = c.stop()
    assert codes == [0, 0], f"daemons exited with {codes}; logs in {c.workdir}"
