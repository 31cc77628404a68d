"""The sender's compare loop, compiled (numba): one run of a block against the shadow,
its changes written in the form the BLOCK16 encoding sends.

A payload's stream is cut into blocks of 65536 elements (`codec.BLOCK`); a change is its
position's low 16 bits (uint16), its new value, and one more in its block's count. The
loop writes exactly that while it compares, so encoding a BLOCK16 body is three copies:
no int64 positions, no re-encoding (POS32 and BITMAP bodies are rebuilt from it).

Two inner steps, the same output:

- **vector** (x86 with AVX-512 VBMI2): per 64 bytes (32 lanes of 1 or 2 bytes, 16 of 4, 8
  of 8): load both, compare lanes, store the new bytes into the shadow, compress the
  changed lanes' values and their low positions in registers (`vpcompress`) and store
  both whole at the end of the output (the lanes past the count are overwritten by the
  next step): no branch on the data at all. Memory-bound on the development VM (13.6
  GB/s of new bytes, the speed of reading two streams and writing one).
- **scalar** (anywhere else): per 64 elements, a compare that LLVM vectorizes into a
  64-bit mask, the shadow copied, then one iteration per set bit (trailing zeros).

A run never crosses a block of the stream, so a vector's low positions never wrap and
each block's count is the run's change count. The output arrays need `SPARE` entries
past `limit` (a vector step stores whole vectors; the loop stops once k > limit).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

try:  # optional: pip install numba
    import numba
    from llvmlite import ir  # type: ignore[import-untyped]
    from numba.core import cgutils as _cgutils
    from numba.core import types
    from numba.extending import intrinsic

    cgutils: Any = _cgutils  # untyped
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None  # type: ignore[assignment]

BLOCK_BITS = 16
SPARE = 64  # output entries a step may write past the count it returns
GROUP = 64  # elements per scalar step (one 64-bit mask)


def lanes(width: int) -> int:
    """Elements per vector step: 64 bytes, at most 32 lanes (positions are 16-bit)."""
    return min(32, 64 // width)


def simd_available() -> bool:
    """Whether numba compiles for a CPU with the vector compress for every width
    (AVX-512 F, BW, VL and VBMI2); WEIGHTWIRE_DELTA_SIMD=0 turns it off."""
    if numba is None or os.environ.get("WEIGHTWIRE_DELTA_SIMD", "1") == "0":
        return False
    from numba.core import codegen, config

    features: Any = getattr(config, "CPU_FEATURES", None)  # what numba compiles for
    try:
        if features is None:
            host: Any = codegen.get_host_cpu_features
            features = host()
    except (AttributeError, RuntimeError):  # another numba: no vector step, to be safe
        return False
    have = set(str(features).split(","))
    return {"+avx512f", "+avx512bw", "+avx512vl", "+avx512vbmi2"} <= have


_vector_step: Any = None
_tz: Any = None
_pc: Any = None
_EVEN = 0x5555555555555555  # bit 0 of every pair of mask bits
if numba is not None:

    def _vector_step_typer(
        typingctx: Any, a: Any, b: Any, i: Any, low: Any, val: Any, k: Any, first: Any
    ) -> Any:
        """Compare a[i:i+L] with b[i:i+L], b[i:i+L] = a[i:i+L]; the changed lanes' values
        to val[k:] and (first + lane) to low[k:], compressed (whole vectors stored).
        Returns the number of changed lanes, plus 2**32 times the number of byte pairs
        (0, 1), (2, 3).. of the step that both changed (1- and 2-byte lanes; see
        `_run_py`'s `pairs`)."""
        sig = types.int64(a, b, types.intp, low, val, types.intp, types.intp)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            av, bv, iv, lowv, valv, kv, firstv = args
            aty, _, _, lowty, valty, _, _ = signature.args
            bits = aty.dtype.bitwidth
            n = lanes(bits // 8)
            et, i16 = ir.IntType(bits), ir.IntType(16)
            vt, pt = ir.VectorType(et, n), ir.VectorType(i16, n)
            mt = ir.VectorType(ir.IntType(1), n)

            def at(arrty: Any, arr: Any, index: Any, vtype: Any) -> Any:
                data = context.make_array(arrty)(context, builder, arr).data
                return builder.bitcast(builder.gep(data, [index]), vtype.as_pointer())

            def compress(vtype: Any, name: str) -> Any:
                fnty = ir.FunctionType(vtype, [vtype, mt, vtype])
                return cgutils.get_or_insert_function(
                    builder.module, fnty, f"llvm.experimental.vector.compress.{name}"
                )

            pa, pb = at(aty, av, iv, vt), at(aty, bv, iv, vt)
            x = builder.load(pa, align=1)
            y = builder.load(pb, align=1)
            mask = builder.icmp_unsigned("!=", x, y)
            builder.store(x, pb, align=1)
            head = builder.insert_element(
                ir.Constant(pt, ir.Undefined), builder.trunc(firstv, i16), ir.IntType(32)(0)
            )
            zeros = ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n)
            spread = builder.shuffle_vector(head, ir.Constant(pt, ir.Undefined), zeros)
            where = builder.add(spread, ir.Constant(pt, list(range(n))))
            undef_p, undef_v = ir.Constant(pt, ir.Undefined), ir.Constant(vt, ir.Undefined)
            packed_p = builder.call(compress(pt, f"v{n}i16"), [where, mask, undef_p])
            packed_v = builder.call(compress(vt, f"v{n}i{bits}"), [x, mask, undef_v])
            builder.store(packed_p, at(lowty, lowv, kv, pt), align=1)
            builder.store(packed_v, at(valty, valv, kv, vt), align=1)
            word = ir.IntType(n)
            popcount = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(word, [word]), f"llvm.ctpop.i{n}"
            )
            count = builder.call(popcount, [builder.bitcast(mask, word)])
            i64 = ir.IntType(64)
            if bits > 16:  # pairs are counted for 1- and 2-byte elements only
                return builder.zext(count, i64)
            nb = n * bits // 8  # bytes in the step
            bt, bw = ir.VectorType(ir.IntType(8), nb), ir.IntType(nb)
            bytes_changed = builder.icmp_unsigned(
                "!=", builder.bitcast(x, bt), builder.bitcast(y, bt)
            )
            changed = builder.bitcast(bytes_changed, bw)
            even = ir.Constant(bw, sum(1 << j for j in range(0, nb, 2)))
            after = builder.lshr(changed, ir.Constant(bw, 1))
            pairs = builder.ctpop(builder.and_(builder.and_(changed, after), even))
            high = builder.shl(builder.zext(pairs, i64), ir.Constant(i64, 32))
            return builder.or_(builder.zext(count, i64), high)

        return sig, codegen

    def _tz_typer(typingctx: Any, x: Any) -> Any:
        """Trailing zeros of a nonzero uint64."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.cttz(args[0], ir.IntType(1)(0))

        return types.uint64(types.uint64), codegen

    def _pc_typer(typingctx: Any, x: Any) -> Any:
        """Set bits of a uint64."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.ctpop(args[0])

        return types.uint64(types.uint64), codegen

    _vector_step, _tz = intrinsic(_vector_step_typer), intrinsic(_tz_typer)
    _pc = intrinsic(_pc_typer)


def _both_bytes_py(x: Any, y: Any) -> int:
    """1 where 2-byte elements x and y differ in both bytes, else 0."""
    d = x ^ y
    return 1 if d & 0xFF and d >> 8 else 0


_both_bytes: Any = (
    numba.njit(cache=True, inline="always")(_both_bytes_py) if numba is not None else None
)


def _run_py(
    a: Any,
    b: Any,
    low: Any,
    val: Any,
    counts: Any,
    k: int,
    limit: int,
    pos0: int,
    simd: bool,
    pairs: Any,
) -> Any:
    """Elements a (new) against b (the shadow, left equal to a), a and b of one integer
    dtype and size, the first at position `pos0` of the payload's stream: each changed
    element's low 16 position bits into low[k], its value into val[k], one more into
    counts[its position >> 16]. Stops after the step that takes k past `limit`.
    pairs[0] grows by the pairs of bytes (2j, 2j+1) of the stream (pos0 even) that both
    changed, for 1- and 2-byte elements: compared as bytes, the changes that are not one
    more changed 2-byte element; compared as 2-byte elements, the changes that are two
    changed bytes. Returns (k, elements done); b equals a over the elements done."""
    n = a.size
    step = min(32, 64 // a.itemsize)
    i = 0
    both: Any = 0
    while i < n:
        p = pos0 + i
        blk = p >> BLOCK_BITS
        end = min(n, i + ((1 << BLOCK_BITS) - (p & 0xFFFF)))
        k0 = k
        if simd:
            while i + step <= end and k <= limit:
                got = _vector_step(a, b, i, low, val, k, (pos0 + i) & 0xFFFF)
                k += got & 0xFFFFFFFF
                both += got >> 32
                i += step
        while i + GROUP <= end and k <= limit:
            ag, bg = a[i : i + GROUP], b[i : i + GROUP]
            m = np.uint64(0)
            for e in range(GROUP):
                m |= np.uint64(ag[e] != bg[e]) << np.uint64(e)
            if a.itemsize == 1:
                both += np.int64(_pc(m & (m >> np.uint64(1)) & np.uint64(_EVEN)))
            elif a.itemsize == 2 and m:
                for e in range(GROUP):
                    both += _both_bytes(ag[e], bg[e])
            for e in range(GROUP):
                bg[e] = ag[e]
            first = (pos0 + i) & 0xFFFF
            while m:
                j = np.int64(_tz(m))
                low[k] = first + j
                val[k] = ag[j]
                k += 1
                m &= m - np.uint64(1)
            i += GROUP
        before = False
        while i < end and k <= limit:
            x = a[i]
            low[k] = (pos0 + i) & 0xFFFF
            val[k] = x
            changed = x != b[i]
            if a.itemsize == 1:
                if changed and before and (pos0 + i) & 1:
                    both += 1
            elif a.itemsize == 2:
                both += _both_bytes(x, b[i])
            before = changed
            k += changed
            b[i] = x
            i += 1
        counts[blk] += k - k0
        if k > limit:
            pairs[0] += both
            return k, i
    pairs[0] += both
    return k, n


_run = numba.njit(cache=True, nogil=True)(_run_py) if numba is not None else None
SIMD = simd_available()


def compiled() -> bool:
    return _run is not None


def run(
    a: np.ndarray,
    b: np.ndarray,
    low: np.ndarray,
    val: np.ndarray,
    counts: np.ndarray,
    k: int,
    limit: int,
    pos0: int,
    simd: bool | None = None,
    pairs: np.ndarray | None = None,
) -> tuple[int, int]:
    """`_run_py` compiled, with its bounds checked here (the compiled loop checks none):
    (k, elements done). `pairs` (int64, at least one): pairs[0] grows as `_run_py` says."""
    assert _run is not None, "numba is not installed"
    n = a.size
    if b.size != n or b.dtype != a.dtype or val.dtype != a.dtype or a.ndim != 1 or b.ndim != 1:
        raise ValueError("a run compares two flat arrays of one dtype and size")
    if pos0 < 0 or (n and (pos0 + n + 0xFFFF) >> BLOCK_BITS > counts.size):
        raise ValueError(f"positions {pos0}..{pos0 + n} past {counts.size} blocks")
    room = min(low.size, val.size)
    if k < 0 or room < min(limit, k + n) + SPARE:
        raise ValueError(f"room for {room} changes, {min(limit, k + n) + SPARE} needed")
    if pairs is None:
        pairs = np.zeros(1, np.int64)
    elif pairs.dtype != np.int64 or pairs.size < 1:
        raise ValueError("pairs is an int64 array of at least one")
    got, done = _run(a, b, low, val, counts, k, limit, pos0, SIMD if simd is None else simd, pairs)
    return int(got), int(done)


def warm() -> None:
    """Compile (or load from numba's cache) every width, both steps."""
    if _run is None:
        return
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        a = np.zeros(8, dtype=dt)
        out = np.zeros(8 + SPARE, dtype=dt)
        run(a, a.copy(), np.zeros(8 + SPARE, np.uint16), out, np.zeros(1, np.uint32), 0, 8, 0)
