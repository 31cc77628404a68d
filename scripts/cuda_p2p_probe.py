"""How fast can a third process copy between two other processes' GPU memory?

The exporter (torch) allocates 2 GiB on GPU a and GPU b and hands out their CUDA IPC
handles; this process (ctypes driver only, like the daemon) opens them and copies a -> b
with each strategy the cuda transport knows, and beside it torch's own peer copy rate.
Run on a machine with >= 2 GPUs: python scripts/cuda_p2p_probe.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

N = 2 << 30
CHUNK = 32 << 20

EXPORTER = r"""
import sys, json, time, torch
from weightwire.memory.cudadrv import driver
a = torch.empty(N, dtype=torch.uint8, device="cuda:0")
b = torch.empty(N, dtype=torch.uint8, device="cuda:1")
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(5):
    b.copy_(a)
torch.cuda.synchronize()
torch_rate = 5 * a.numel() / (time.perf_counter() - t) / 1e9
drv = driver()
out = {"torch_gbps": torch_rate}
for name, t_ in (("a", a), ("b", b)):
    drv.use(t_.device.index)
    base, _ = drv.address_range(t_.data_ptr())
    out[name] = {"handle": drv.ipc_handle(base).hex(), "offset": t_.data_ptr() - base,
                 "uuid": drv.devices[t_.device.index].uuid}
print(json.dumps(out), flush=True)
sys.stdin.readline()
"""


def main() -> None:
    exp = subprocess.Popen(
        [sys.executable, "-c", f"N = {N}\n{EXPORTER}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    info = json.loads(exp.stdout.readline())
    from weightwire.memory.cudadrv import driver

    drv = driver()
    drv.enable_peer_access()
    dev = {k: drv.ordinal_of(info[k]["uuid"]) for k in ("a", "b")}
    handles = {k: bytes.fromhex(info[k]["handle"]) for k in ("a", "b")}
    drv.use(dev["a"])
    a = drv.ipc_open(handles["a"]) + info["a"]["offset"]
    drv.use(dev["b"])
    b = drv.ipc_open(handles["b"]) + info["b"]["offset"]
    results = {"torch_peer_copy_gbps": round(info["torch_gbps"], 1)}

    def run(name: str, copy) -> None:  # type: ignore[no-untyped-def]
        drv.use(dev["a"])
        s = drv.stream()
        for _ in range(2):
            copy(s)
        drv.synchronize(s)
        t = time.perf_counter()
        for _ in range(3):
            copy(s)
        drv.synchronize(s)
        results[name] = round(3 * N / (time.perf_counter() - t) / 1e9, 1)

    def chunks(dst: int, src: int, fn):  # type: ignore[no-untyped-def]
        return lambda s: [fn(dst + o, src + o, CHUNK, s) for o in range(0, N, CHUNK)]

    run("plain_gbps", chunks(b, a, drv.copy_async))
    run(
        "peer_gbps",
        chunks(b, a, lambda d, s_, n, st: drv.copy_peer_async(d, dev["b"], s_, dev["a"], n, st)),
    )
    drv.use(dev["a"])
    try:
        b_in_a = drv.ipc_open(handles["b"]) + info["b"]["offset"]
        run("map_gbps", chunks(b_in_a, a, drv.copy_async))
    except Exception as exc:
        results["map_error"] = repr(exc)
    print(json.dumps(results))
    exp.stdin.write("\n")
    exp.stdin.flush()
    exp.wait(30)


if __name__ == "__main__":
    main()
