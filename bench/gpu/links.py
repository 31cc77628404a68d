"""The copy rate of every link the benchmark uses, measured in the same run (its own
process, before the ranks start): `python -m weightwire.bench.gpu.links ...` prints JSON.

- pair `i->j`: one large peer copy from GPU i to GPU j (the copy engines over NVLink or
  PCIe), alone; the best of a few repetitions (a GPU that sat idle runs its first copies
  slower: a same-GPU copy measured 873 against 1496 GB/s on an H100, and one of three
  measures of the same copy came out at half rate; the best one is the link's rate, and
  keeps the fractions reported against it from being flattered).
- `out i` / `in j`: every pair leaving GPU i (arriving at GPU j) at once, on streams of
  their own: what GPU i can send (j can receive) in total.
- `d2h i` / `h2d j`: GPU to pinned host memory and back (the CPU replica's stages).

With `--device cpu` every "link" is a host memory copy (only to exercise the program).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        a, b = item.split(":")
        out.append((int(a), int(b)))
    return out


def _sync(devices: set[int]) -> None:
    for d in sorted(devices):
        torch.cuda.synchronize(d)


def _timed(run: Any, devices: set[int], reps: int) -> float:
    run()  # warm: peer mappings, first-touch
    _sync(devices)
    times = []
    for _ in range(reps):
        _sync(devices)
        t0 = time.perf_counter()
        run()
        _sync(devices)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_cuda(
    pairs: list[tuple[int, int]], nbytes: int, reps: int, host: bool
) -> dict[str, Any]:
    gpus = sorted({g for p in pairs for g in p})
    bufs = {g: torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{g}") for g in gpus}
    for g in gpus:
        bufs[g].fill_(g + 1)
    dst_bufs = {
        p: (torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{p[1]}") if p[0] != p[1] else None)
        for p in pairs
    }
    streams = {p: (torch.cuda.Stream(device=p[0]), torch.cuda.Stream(device=p[1])) for p in pairs}

    def copy(ps: list[tuple[int, int]]) -> None:
        for p in ps:
            src_stream, dst_stream = streams[p]
            dst = dst_bufs[p]
            if dst is None:  # both ranks on one GPU: a device-local copy
                with torch.cuda.stream(src_stream):
                    half = nbytes // 2
                    bufs[p[0]][:half].copy_(bufs[p[0]][half : 2 * half], non_blocking=True)
                continue
            # the copy runs on the source's current stream and fences the destination's:
            # give each pair streams of its own on both sides, so pairs run concurrently
            with torch.cuda.stream(dst_stream), torch.cuda.stream(src_stream):
                dst.copy_(bufs[p[0]], non_blocking=True)

    out: dict[str, Any] = {"bytes": nbytes, "reps": reps, "pairs": {}, "out": {}, "in": {}}
    for p in pairs:
        moved = nbytes if p[0] != p[1] else nbytes // 2
        s = _timed(lambda p=p: copy([p]), set(p), reps)
        out["pairs"][f"{p[0]}->{p[1]}"] = moved / s / 1e9
    for g in sorted({p[0] for p in pairs}):
        ps = [p for p in pairs if p[0] == g]
        moved = sum(nbytes if p[0] != p[1] else nbytes // 2 for p in ps)
        s = _timed(lambda ps=ps: copy(ps), {x for p in ps for x in p}, reps)
        out["out"][str(g)] = moved / s / 1e9
    for g in sorted({p[1] for p in pairs}):
        ps = [p for p in pairs if p[1] == g]
        moved = sum(nbytes if p[0] != p[1] else nbytes // 2 for p in ps)
        s = _timed(lambda ps=ps: copy(ps), {x for p in ps for x in p}, reps)
        out["in"][str(g)] = moved / s / 1e9
    if host:
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out["d2h"], out["h2d"] = {}, {}
        for g in gpus:
            s = _timed(lambda g=g: pinned.copy_(bufs[g], non_blocking=True), {g}, reps)
            out["d2h"][str(g)] = nbytes / s / 1e9
            s = _timed(lambda g=g: bufs[g].copy_(pinned, non_blocking=True), {g}, reps)
            out["h2d"][str(g)] = nbytes / s / 1e9
    out["what"] = "peer copies between GPUs (torch copy_, copy engines)"
    return out


def measure_cpu(pairs: list[tuple[int, int]], nbytes: int, reps: int) -> dict[str, Any]:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    dst.copy_(src)
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    rate = nbytes / statistics.median(times) / 1e9
    return {
        "bytes": nbytes,
        "reps": reps,
        "pairs": {f"{a}->{b}": rate for a, b in pairs},
        "out": {str(a): rate for a in sorted({a for a, _ in pairs})},
        "in": {str(b): rate for b in sorted({b for _, b in pairs})},
        "d2h": {},
        "h2d": {},
        "what": "host memory copies (--device cpu: no links; exercises the program only)",
    }


def devices() -> dict[str, Any]:
    """The GPUs, their names and memory (free, total), and the software versions."""
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": []}
    if torch.cuda.is_available():
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # pragma: no cover - no NCCL in this build
            info["nccl"] = None
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            info["gpus"].append(
                {"index": i, "name": torch.cuda.get_device_name(i), "free": free, "total": total}
            )
    return info


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--pairs", default="", help="src:dst GPU pairs, comma separated")
    p.add_argument("--mb", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--host", action="store_true", help="also GPU <-> pinned host rates")
    p.add_argument("--info-only", action="store_true")
    args = p.parse_args()
    result: dict[str, Any] = {"devices": devices()}
    pairs = _pairs(args.pairs)
    if not args.info_only and pairs:
        nbytes = args.mb << 20
        if args.device == "cuda":
            result["links"] = measure_cuda(pairs, nbytes, args.reps, args.host)
        else:
            result["links"] = measure_cpu(pairs, min(nbytes, 64 << 20), args.reps)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
