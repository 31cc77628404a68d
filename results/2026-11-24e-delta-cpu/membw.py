"""This VM's memory bandwidth, one thread and two: reading 1 GiB, reading two, copying, and
reading two while writing one back in place (the sender's compare: new bytes and the
shadow read, the shadow written), then that on two threads at once (the sender and the
engine of a delta version, each on its own 1 GiB).

    .venv/bin/python results/2026-11-24e-delta-cpu/membw.py
"""

from __future__ import annotations

import threading
import time

import numba
import numpy as np

N = 1 << 30


@numba.njit(nogil=True)
def read1(a: np.ndarray) -> int:
    s = np.uint64(0)
    for i in range(a.size):
        s ^= a[i]
    return s


@numba.njit(nogil=True)
def read2(a: np.ndarray, b: np.ndarray) -> int:
    s = np.uint64(0)
    for i in range(a.size):
        s ^= a[i] ^ b[i]
    return s


@numba.njit(nogil=True)
def copy(a: np.ndarray, b: np.ndarray) -> None:
    for i in range(a.size):
        b[i] = a[i]


@numba.njit(nogil=True)
def compare(a: np.ndarray, b: np.ndarray) -> int:
    s = np.uint64(0)
    for i in range(a.size):
        s ^= a[i] ^ b[i]
        b[i] = a[i]
    return s


def main() -> None:
    a, b, c, d, e = (np.ones(N // 8, np.uint64) for _ in range(5))
    runs = (("read 1", read1, (a,), 1), ("read 2", read2, (a, b), 2), ("copy", copy, (a, c), 2))
    runs += (("read 2, write 1 back", compare, (a, b), 3),)
    for _, f, args, _ in runs:
        f(*args)  # compiled before it is timed
    for name, f, args, gb in runs:
        t = time.perf_counter()
        f(*args)
        dt = time.perf_counter() - t
        print(f"{name}: {dt:.4f} s, {gb * N / dt / 1e9:.1f} GB/s")
    times: list[float] = []

    def one(x: np.ndarray, y: np.ndarray) -> None:
        t = time.perf_counter()
        compare(x, y)
        times.append(time.perf_counter() - t)

    threads = [threading.Thread(target=one, args=p) for p in ((a, b), (d, e))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    print(
        f"two threads, read 2 write 1 each: {', '.join(f'{x:.4f}' for x in times)} s, "
        f"{6 * N / wall / 1e9:.1f} GB/s in all"
    )


if __name__ == "__main__":
    main()
