"""SGLang's memory saver on a GPU: engine parameters in CUDA VMM memory (cuMemCreate, as
torch_memory_saver allocates them), registered through POSIX fds, published bitwise;
released (the daemon drops its mapping, so the GPU memory really goes back) and resumed
(new physical memory at the same addresses), re-registered without restarting the
daemon, published bitwise again. Memory without a shareable handle type (what
torch_memory_saver makes) is refused saying what to set. One daemon, trainer and engine
on GPU 0 (colocated), the cuda transport.

Needs a GPU: run by scripts/gpu-suite.sh (SUITE_TEST_FILES=tests/test_memory_saver_gpu.py);
skipped elsewhere, saying why. torch_memory_saver comes from the carried .whl/ if at all.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.memory import vmm
from weightwire.memory.cudadrv import available, driver
from weightwire.protocol.errors import RegistrationError, WeightwireError

from .conftest import FAST

OK, WHY = available()
if OK and not torch.cuda.is_available():
    OK, WHY = False, "torch sees no CUDA device (a CPU build of torch?)"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")]

MB = 1 << 20
NBYTES = 64 * MB  # big enough that freeing it shows in cuMemGetInfo


class _Mem:
    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
        }


def params_in(owned: vmm.Owned) -> dict[str, torch.Tensor]:
    """Two parameters in one VMM allocation, as a memory-saver engine's weights are."""
    dev = torch.device("cuda", owned.device)
    w1 = torch.as_tensor(_Mem(owned.base, (1024, 1024), "<f4"), device=dev)  # 4 MiB
    w2 = torch.as_tensor(_Mem(owned.base + 8 * MB, (4096, 2048), "<f2"), device=dev)  # 16 MiB
    return {"w1": w1, "w2": w2.view(torch.bfloat16)}


def sources(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "w1": torch.randn(1024, 1024, device="cuda:0", generator=g),
        "w2": torch.randn(4096, 2048, device="cuda:0", generator=g).to(torch.bfloat16),
    }


@pytest.fixture(scope="module")
def daemon() -> Iterator[LocalCluster]:
    c = LocalCluster(hosts=1, extra={**FAST, "cuda": "on"})
    c.start()
    yield c
    codes = c.stop()
    assert codes == [0], f"daemon exited with {codes}; logs in {c.workdir}"


def free_bytes() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info(0)[0])


def test_vmm_engine_memory_published_released_resumed_bitwise(daemon: LocalCluster) -> None:
    drv = driver()
    drv.use(0)
    owned = vmm.create(drv, NBYTES, 0, vmm.HANDLE_TYPE_POSIX_FD)
    sock = daemon.daemons[0].socket
    job = "vmm"
    tr = eng = None
    try:
        dst = params_in(owned)
        for t in dst.values():
            t.zero_()
        chunk = vmm.chunk_at(drv, dst["w2"].data_ptr())
        assert chunk is not None and chunk.posix_fd_ok and chunk.base == owned.base
        eng = Engine(0, 1, socket=sock, job=job, timeout_s=60, device=0)
        eng.register(dst)
        status = fetch(sock)
        src = sources(1)
        tr = Trainer(0, 1, socket=sock, job=job, timeout_s=60, device=0)
        tr.register(src)
        tr.publish(1)
        eng.wait(1, timeout_s=60)
        for n in src:
            assert torch.equal(dst[n].view(torch.uint8), src[n].view(torch.uint8)), n
        cuda_bytes = fetch(sock)["transports"]["cuda"]["bytes_sent"]
        assert cuda_bytes >= sum(t.numel() * t.element_size() for t in src.values())

        # release: the daemon lets go first, then the engine's memory goes back to the GPU
        before = free_bytes()
        eng.release_gpu_memory()
        vmm.release(drv, owned)
        freed = free_bytes() - before
        assert freed >= owned.size // 2, (
            f"releasing {owned.size} bytes freed {freed}: a mapping still holds them"
        )
        # a version published meanwhile fails; none is reported complete
        with pytest.raises(WeightwireError):
            tr.publish(2)

        # resume: new physical memory at the same addresses (contents lost), registered again
        vmm.remap(drv, owned)
        for t in dst.values():
            t.zero_()
        eng.resume_gpu_memory()
        for n, t in sources(3).items():  # new values in the trainer's registered tensors
            src[n].copy_(t)
        torch.cuda.synchronize()
        tr.publish(3)
        eng.wait(3, timeout_s=60)
        for n in src:
            assert torch.equal(dst[n].view(torch.uint8), src[n].view(torch.uint8)), n
        assert daemon.daemons[0].proc.poll() is None  # the same daemon process throughout
        assert fetch(sock)["node"] == status["node"]
    finally:
        for client in (tr, eng):
            if client is not None:
                client.close()
        gc.collect()
        vmm.destroy(drv, owned)


def test_vmm_memory_without_a_shareable_handle_is_refused_naming_the_parameter(
    daemon: LocalCluster,
) -> None:
    """torch_memory_saver's allocations (no requestedHandleTypes): refused with what to set;
    the daemon keeps serving."""
    drv = driver()
    drv.use(0)
    owned = vmm.create(drv, 32 * MB, 0, 0)
    sock = daemon.daemons[0].socket
    try:
        eng = Engine(0, 1, socket=sock, job="unshareable", timeout_s=30, device=0)
        with pytest.raises(RegistrationError) as err:
            eng.register(params_in(owned))
        msg = err.value.message
        assert "parameters w1, w2" in msg
        assert "--enable-memory-saver" in msg and "expandable_segments:True" in msg
        eng.close()
    finally:
        vmm.destroy(drv, owned)
    assert fetch(sock)["node"] == "host0"


_TMS_CHILD = r"""
import json, os, sys
import torch
def out(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
    os._exit(0)  # torch_memory_saver aborts in its own teardown (tms_torch_free): skip it
try:
    from torch_memory_saver import torch_memory_saver as tms
except Exception as exc:
    out(skip=f"torch_memory_saver does not import here: {exc!r}")
try:
    tms.hook_mode = "torch"
    with tms.region():
        w = torch.full((4 << 20,), 7, dtype=torch.uint8, device="cuda:0")
except Exception as exc:
    out(skip=f"torch_memory_saver does not allocate here: {exc!r}")
from weightwire.client import Engine
from weightwire.memory import vmm
from weightwire.memory.cudadrv import driver
from weightwire.protocol.errors import WeightwireError
drv = driver()
drv.use(0)
chunk = vmm.chunk_at(drv, w.data_ptr())
if chunk is None:
    out(vmm=False)
eng = Engine(0, 1, socket=sys.argv[1], job="tms", timeout_s=30, device=0)
try:
    eng.register({"model.w": w})
    out(vmm=True, fd_ok=chunk.posix_fd_ok, registered=True)
except WeightwireError as exc:
    out(vmm=True, fd_ok=chunk.posix_fd_ok, registered=False,
        error=type(exc).__name__, message=exc.message)
"""


def test_torch_memory_saver_weights_are_refused_saying_what_to_set(daemon: LocalCluster) -> None:
    """The real torch_memory_saver (from PyPI, carried in .whl/), as SGLang's
    --enable-memory-saver uses it: its memory is VMM without a shareable handle type. In a
    child process: its hooked allocator stays in the process that loaded it (and aborts in
    its own teardown), so it must not share one with the other tests."""
    done = subprocess.run(
        [sys.executable, "-c", _TMS_CHILD, daemon.daemons[0].socket],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"the child printed no result (rc {done.returncode}): {done.stderr[-2000:]}"
    res = json.loads(lines[-1][len("RESULT ") :])
    if "skip" in res:
        pytest.skip(res["skip"])
    assert res["vmm"], "torch_memory_saver memory is not VMM memory?"
    if res["fd_ok"]:  # a torch_memory_saver that allows fds: it must just work
        assert res["registered"], res
        return
    assert not res["registered"], "memory without a shareable handle was accepted"
    assert res["error"] == "RegistrationError", res
    assert "parameter model.w" in res["message"]
    assert "--enable-memory-saver" in res["message"]


def test_expandable_segments_engine_memory_lands_bitwise(daemon: LocalCluster) -> None:
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: PyTorch's VMM segments, one
    tensor across several of them; registered through fds (CUDA IPC cannot take them)."""
    torch.cuda.empty_cache()  # no cached plain segment may serve the tensors below
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    sock = daemon.daemons[0].socket
    tr = eng = None
    try:
        dst = {
            "big": torch.zeros(24 * MB // 4, device="cuda:0"),
            "small": torch.zeros(77, device="cuda:0"),
        }
        drv = driver()
        drv.use(0)
        chunk = vmm.chunk_at(drv, dst["big"].data_ptr())
        if chunk is None:
            pytest.skip("this torch's expandable segments are not VMM memory")
        eng = Engine(0, 1, socket=sock, job="expandable", timeout_s=60, device=0)
        eng.register(dst)
        src = {n: torch.randn(t.shape, device="cuda:0") for n, t in dst.items()}
        tr = Trainer(0, 1, socket=sock, job="expandable", timeout_s=60, device=0)
        tr.register(src)
        tr.publish(1)
        eng.wait(1, timeout_s=60)
        for n in src:
            assert torch.equal(dst[n], src[n]), n
    finally:
        for client in (tr, eng):
            if client is not None:
                client.close()
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
