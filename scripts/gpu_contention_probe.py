"""Does packing on a trainer GPU slow the copy engines' NVLink copies out of it?

Measures a peer copy GPU A -> GPU B alone, then while GPU A is kept busy by pack-like work,
issued from another process (as the trainer packs while the daemon copies) or from the
same one. The copy is torch's peer copy, and the cuda transport's own driver calls: one
1-D copy, one 2-D copy of expert-slice rows (a strided write), the same rows as 1-D
copies. Prints JSON lines.

    python scripts/gpu_contention_probe.py [--src 0 --dst 1 --gb 1 --reps 6]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import threading
import time
from typing import Any

import torch

LOADS = ("idle", "strided", "contig-kernel", "contig-memcpy")


def _load_step(kind: str, bufs: dict[str, torch.Tensor]) -> None:
    src, dst = bufs["src"], bufs["dst"]
    if kind == "idle":  # a context on the GPU, and no work
        return
    if kind == "strided":
        # the w2 halves of an FSDP shard: rows of 1536 B, the left 768 B of each row
        dst.view(-1, 384).copy_(src.view(-1, 768)[:, :384])
    elif kind == "contig-kernel":
        torch._foreach_copy_([dst], [src[: dst.numel()]])
    elif kind == "contig-memcpy":
        dst.copy_(src[: dst.numel()])  # same dtype, contiguous: cudaMemcpyAsync D2D


def _make_load(device: int, gb: float) -> dict[str, torch.Tensor]:
    n = int(gb * (1 << 30)) // 2 // 768 * 768
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    return {"src": src, "dst": torch.empty(n // 2, dtype=torch.bfloat16, device=device)}


def _run_load(kind: str, device: int, stop: Any, ready: Any, stats: dict[str, float]) -> None:
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device)
    bufs = _make_load(device, 4.0)
    with torch.cuda.stream(stream):
        _load_step(kind, bufs)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(3):
        with torch.cuda.stream(stream):
            _load_step(kind, bufs)
    torch.cuda.synchronize(device)
    step = (time.perf_counter() - t) / 3
    moved = bufs["dst"].numel() * 2 * 2  # read + write
    stats["load_step_ms"] = step * 1e3
    stats["load_gbps"] = moved / step / 1e9 if kind != "idle" else 0.0
    ready.set()
    steps = 0
    while not stop.is_set():
        if kind == "idle":
            time.sleep(0.01)
            continue
        with torch.cuda.stream(stream):
            for _ in range(4):
                _load_step(kind, bufs)
        stream.synchronize()
        steps += 4
    stats["load_steps"] = steps


def _load_process(kind: str, device: int, stop: Any, ready: Any, q: Any) -> None:
    stats: dict[str, float] = {}
    _run_load(kind, device, stop, ready, stats)
    q.put(stats)


def _copy_rate(a: int, b: int, src: torch.Tensor, dst: torch.Tensor, reps: int) -> float:
    stream = torch.cuda.Stream(a)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()
    t = time.perf_counter()
    with torch.cuda.stream(stream):
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
    stream.synchronize()
    torch.cuda.synchronize(b)
    return src.numel() * reps / (time.perf_counter() - t) / 1e9


ROW = 786_432  # one expert's w2 slice at FSDP-2 -> TP-2


def _driver_rate(shape: str, drv: Any, stream: int, d: int, s: int, rows: int, reps: int) -> float:
    """GB/s of the cuda transport's copies (ctypes driver) of `rows` ROW-byte blocks, from
    contiguous `s` to every other block at `d`: one 1-D copy, one 2-D copy, or the rows one
    by one."""

    def issue() -> None:
        if shape == "1d":
            drv.copy_async(d, s, rows * ROW, stream)
        elif shape == "2d":
            drv.copy_2d_async(d, 2 * ROW, s, ROW, ROW, rows, stream)
        else:
            for i in range(rows):
                drv.copy_async(d + 2 * i * ROW, s + i * ROW, ROW, stream)

    issue()
    drv.synchronize(stream)
    t = time.perf_counter()
    for _ in range(reps):
        issue()
    drv.synchronize(stream)
    return reps * rows * ROW / (time.perf_counter() - t) / 1e9


def _rates(a: int, b: int, src: torch.Tensor, dst: torch.Tensor, reps: int) -> dict[str, float]:
    from weightwire.transport.cudadrv import driver

    drv = driver()
    drv.enable_peer_access()
    drv.use(a)
    stream = drv.stream()
    rows = src.numel() // (2 * ROW)
    out = {"torch": _copy_rate(a, b, src, dst, reps)}
    for shape in ("1d", "2d", "rows"):
        out[shape] = _driver_rate(shape, drv, stream, dst.data_ptr(), src.data_ptr(), rows, reps)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--src", type=int, default=0)
    p.add_argument("--dst", type=int, default=1)
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--ipc", action="store_true", help="only the daemon's case (IPC buffers)")
    args = p.parse_args()
    if args.ipc:
        ipc_main(args.src, args.dst, args.gb, args.reps)
        return
    a, b = args.src, args.dst
    n = int(args.gb * (1 << 30))
    src = torch.ones(n, dtype=torch.uint8, device=a)
    dst = torch.empty(n, dtype=torch.uint8, device=b)
    print(json.dumps({"case": "alone", "gbps": _rates(a, b, src, dst, args.reps)}), flush=True)
    ctx = mp.get_context("spawn")
    for where in ("other-process", "same-process"):
        for kind in LOADS if where == "other-process" else ("strided",):
            stats: dict[str, Any] = {}
            if where == "other-process":
                stop, ready, q = ctx.Event(), ctx.Event(), ctx.Queue()
                proc = ctx.Process(target=_load_process, args=(kind, a, stop, ready, q))
                proc.start()
                ready.wait(120)
                rate = _rates(a, b, src, dst, args.reps)
                stop.set()
                stats = q.get(timeout=60)
                proc.join(60)
            else:
                tstop, tready = threading.Event(), threading.Event()
                th = threading.Thread(target=_run_load, args=(kind, a, tstop, tready, stats))
                th.start()
                tready.wait(120)
                rate = _rates(a, b, src, dst, args.reps)
                tstop.set()
                th.join(60)
                torch.cuda.empty_cache()
            row = {"case": f"{where}:{kind}", "gbps": rate, **stats}
            print(json.dumps(row), flush=True)
    print(json.dumps({"case": "alone-again", "gbps": _rates(a, b, src, dst, args.reps)}))


def _exporter(a: int, b: int, gb: float, q: Any, load: Any, stop: Any) -> None:
    """Owns the copy's buffers (as a trainer owns staging and an engine its weights) and
    packs on GPU a whenever `load` is set: deep queues, eager or as a CUDA graph."""
    from weightwire.transport.cudadrv import driver

    n = int(gb * (1 << 30))
    src = torch.ones(n, dtype=torch.uint8, device=a)
    dst = torch.empty(n, dtype=torch.uint8, device=b)
    bufs = _make_load(a, 4.0)
    # a pack's worth of small strided copies (w2 halves: 1024 rows of 768 B), as a graph
    w2 = [torch.randn(1024, 768, dtype=torch.bfloat16, device=a) for _ in range(256)]
    stage = torch.empty(256 * 1024 * 384, dtype=torch.bfloat16, device=a)
    tiny = [
        (w[:, :384], stage[i * 1024 * 384 : (i + 1) * 1024 * 384].view(1024, 384))
        for i, w in enumerate(w2)
    ]
    stream = torch.cuda.Stream(a)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for s_, d_ in tiny:  # warm
            d_.copy_(s_)
        torch.cuda.synchronize(a)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(16):
                for s_, d_ in tiny:
                    d_.copy_(s_)
    torch.cuda.synchronize(a)
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize(a)
    tiny_graph_ms = (time.perf_counter() - t0) * 1e3
    drv = driver()
    out = {}
    for name, t in (("src", src), ("dst", dst)):
        drv.use(t.device.index)
        base, _ = drv.address_range(t.data_ptr())
        out[name] = (drv.ipc_handle(base), t.data_ptr() - base, t.device.index)
    out["tiny_graph_ms"] = tiny_graph_ms  # 4096 copies of 786 KB
    q.put(out)
    while not stop.is_set():
        kind = load.get()
        if kind is None:
            break
        if kind == "pause":
            continue
        steps = 0
        t0 = time.perf_counter()
        while load.empty():
            with torch.cuda.stream(stream):
                for _ in range(20):
                    if kind == "tiny-graph":
                        graph.replay()
                    elif kind == "tiny-eager":
                        for s_, d_ in tiny:
                            d_.copy_(s_)
                    else:
                        _load_step("strided", bufs)
            stream.synchronize()
            steps += 20
        q.put({"kind": kind, "steps": steps, "s": time.perf_counter() - t0})


def ipc_main(a: int, b: int, gb: float, reps: int) -> None:
    """The daemon's case: buffers of another process, opened by IPC handle, the destination
    mapped into the copying device's context; that process packs meanwhile."""
    from weightwire.transport.cudadrv import driver

    ctx = mp.get_context("spawn")
    q, load, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_exporter, args=(a, b, gb, q, load, stop))
    proc.start()
    handles = q.get(timeout=120)
    print(json.dumps({"tiny_graph_ms_4096_copies": handles["tiny_graph_ms"]}), flush=True)
    drv = driver()
    drv.enable_peer_access()
    drv.use(a)
    src = drv.ipc_open(handles["src"][0]) + handles["src"][1]
    dst = drv.ipc_open(handles["dst"][0]) + handles["dst"][1]  # mapped into a's context
    stream = drv.stream()
    rows = int(gb * (1 << 30)) // (2 * ROW)

    def rate(shape: str) -> float:
        return _driver_rate(shape, drv, stream, dst, src, rows, reps)

    for kind in (None, "strided", "tiny-graph", "tiny-eager", None):
        if kind is not None:
            load.put(kind)
            time.sleep(0.3)
        row = {"case": f"ipc:{kind or 'alone'}", "1d": rate("1d"), "2d": rate("2d")}
        if kind is not None:
            load.put("pause")  # ends this load; the exporter reports it
            row["load"] = q.get(timeout=60)
        print(json.dumps(row), flush=True)
    load.put(None)
    stop.set()
    proc.join(30)


if __name__ == "__main__":
    main()
