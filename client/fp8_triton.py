"""The Triton functions of the FP8 block quantization (`fp8_kernel`): the kernel, one
program per tile (`quantize`, jit-compiled on first use by `fp8_kernel._kernel`), and its
helpers. Defined only where Triton is installed."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the torch path packs every FP8 box
    triton = None
    tl = None

if triton is not None:

    @triton.jit  # type: ignore[untyped-decorator,unused-ignore]
    def _codes(xf, scale, fast, HW_CVT: tl.constexpr, FAST_DIV: tl.constexpr):  # type: ignore[no-untyped-def]
        """e4m3fn codes (int32) of float32(x) / scale, the quotient IEEE-rounded."""
        xbits = xf.to(tl.int32, bitcast=True)
        if FAST_DIV:
            if fast:  # a finite tile, amax < 2**80: Markstein's correction, exact here
                y = tl.math.div_rn(1.0, scale)  # RN(1/scale), once per tile
                negs = tl.full(xf.shape, 0.0, tl.float32) - scale
                q = xf * y
                q = tl.math.fma(tl.math.fma(negs, q, xf), y, q)  # within 1 ulp
                q = tl.math.fma(tl.math.fma(negs, q, xf), y, q)  # = RN(x / scale)
                # |x| < 2**-40: |x / scale| < 2**-18, code 0 keeping x's sign (and the
                # remainders above would leave float32's normal range)
                tiny = (xbits & 0x7FFFFFFF) < (87 << 23)
                q = tl.where(tiny, (xbits & -0x80000000).to(tl.float32, bitcast=True), q)
            else:
                q = tl.math.div_rn(xf, tl.full(xf.shape, 0.0, tl.float32) + scale)
        else:
            q = tl.math.div_rn(xf, tl.full(xf.shape, 0.0, tl.float32) + scale)
        bits = q.to(tl.int32, bitcast=True)
        neg = bits < 0
        if HW_CVT:  # cvt.rn.satfinite: c10's codes for |q| < 464; NaN keeps its sign
            hw = q.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
            res = tl.where(q != q, tl.where(neg, 0xFF, 0x7F), hw.to(tl.int32))
        else:
            res = _magnitude_codes(bits & 0x7FFFFFFF) | tl.where(neg, 0x80, 0)
        return res

    @triton.jit  # type: ignore[untyped-decorator,unused-ignore]
    def _magnitude_codes(mag):  # type: ignore[no-untyped-def]
        """c10's fp8e4m3fn_from_fp32_value of |q| (its bits `mag`), in integers: no sign."""
        den = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True)
        den = den - (141 << 23)
        nb = mag + ((-120 << 23) + 0x7FFFF) + ((mag >> 20) & 1)
        nrm = (nb >> 20) & 0xFF
        nrm = tl.where(nrm == 0x7F, 0x7E, nrm)
        big = tl.where(mag > 0x7F800000, 0x7F, 0x7E)
        return tl.where(mag >= (1087 << 20), big, tl.where(mag < (121 << 23), den, nrm))

    @triton.jit  # type: ignore[untyped-decorator,unused-ignore]
    def _codes_finite(xf, scale, HW_CVT: tl.constexpr):  # type: ignore[no-untyped-def]
        """`_codes` of a finite tile with amax < 2**80 (`fast`), in fewer instructions and
        registers (no tiny cut, no NaN test, x not kept past the corrections): the code of
        p = RN(-x / scale), by the reciprocal corrected twice (p + (x + scale * p) * -y),
        with its sign bit flipped (RN is symmetric). Zeros keep their sign through this
        form (x - scale * q would make -0 / scale +0; Triton's unary minus is 0 - x, which
        makes -(+0) +0, so none is used). Below |x| = 2**-40 the corrections need not be
        exact: |p| < 2**-16 codes as a zero of the right sign anyway."""
        y = tl.math.div_rn(1.0, scale)
        negy = 0.0 - y
        s = tl.full(xf.shape, 0.0, tl.float32) + scale
        p = xf * negy
        p = tl.math.fma(tl.math.fma(s, p, xf), negy, p)
        p = tl.math.fma(tl.math.fma(s, p, xf), negy, p)
        if HW_CVT:
            res = p.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
            res = res.to(tl.int32)
        else:
            bits = p.to(tl.int32, bitcast=True)
            res = _magnitude_codes(bits & 0x7FFFFFFF) | tl.where(bits < 0, 0x80, 0)
        return res ^ 0x80

    @triton.jit  # type: ignore[untyped-decorator,unused-ignore]
    def _code_rows(  # type: ignore[no-untyped-def]
        x_at,
        out_at,
        s0,
        c,
        nr,
        nc,
        ncols,
        scale,
        fast,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        HW_CVT: tl.constexpr,
        FAST_DIV: tl.constexpr,
    ):
        # a tile's codes ROWS rows at a time, each slice read again (from L2)
        r = tl.arange(0, ROWS)
        cc = tl.arange(0, BLOCK)
        for k in tl.range(0, BLOCK, ROWS):
            rk = r + k
            within = (rk[:, None] < nr) & (cc[None, :] < nc)
            x = tl.load(x_at + rk[:, None] * s0 + c[None, :], mask=within, other=0.0)
            res = _codes(x.to(tl.float32), scale, fast, HW_CVT, FAST_DIV)
            tl.store(out_at + (rk[:, None] * ncols + cc[None, :]), res.to(tl.uint8), mask=within)

    @triton.jit  # type: ignore[untyped-decorator,unused-ignore]
    def _amax_bits(x):  # type: ignore[no-untyped-def]
        # one reduction for the amax and the NaN test: |x|'s bits order as integers as
        # the values do, and a NaN's bits are above +inf's (0x7F800000)
        xb = x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return tl.max(tl.max(xb, axis=1), axis=0)

    def _quantize(  # type: ignore[no-untyped-def]
        src,
        dst,
        desc,
        tiles,
        BLOCK: tl.constexpr,
        STEP: tl.constexpr,
        ALIGNED: tl.constexpr,
        VEC: tl.constexpr,
        HW_CVT: tl.constexpr,
        FAST_DIV: tl.constexpr,
        FINITE: tl.constexpr = False,
        SLICE: tl.constexpr = 16,
    ):
        """One program per tile: its box's descriptor, its scale, its codes. STEP rows
        at a time: STEP == BLOCK reads the tile once and keeps it in registers; less
        reads it twice (the amax, then the codes; the second read hits L2) with fewer
        registers per program, so more programs (more bytes in flight) per SM. FINITE
        (with STEP == BLOCK): a tile that is finite with amax < 2**80 takes
        `_codes_finite`; any other is coded SLICE rows at a time by the IEEE division."""
        pid = tl.program_id(0)
        d = tl.load(tiles + pid * 3).to(tl.int64)
        ti = tl.load(tiles + pid * 3 + 1).to(tl.int64)
        tj = tl.load(tiles + pid * 3 + 2).to(tl.int64)
        at = desc + d * 8
        rows = tl.load(at + 1)
        scales_at = tl.load(at + 6)
        if ALIGNED:  # stored in vectors: multiples of constants, which Triton can see;
            # offsets inside the tile in int32 (the batch checked that they fit)
            off = tl.load(at) * VEC
            s0 = tl.load(at + 3).to(tl.int32) * VEC
            cols = tl.load(at + 7).to(tl.int32) * 16
            codes_at = tl.load(at + 5) * 16
            r = tl.arange(0, STEP)
            c = tl.arange(0, BLOCK)
            nr = (rows - ti * BLOCK).to(tl.int32)
            nc = cols - tj.to(tl.int32) * BLOCK
            x_at = src + off + ti * BLOCK * s0 + tj * BLOCK
            out_at = dst + codes_at + ti * BLOCK * cols + tj * BLOCK
            ncols = cols
        else:
            off = tl.load(at)
            s0 = tl.load(at + 3)
            s1 = tl.load(at + 4)
            ncols = tl.load(at + 2)
            codes_at = tl.load(at + 5)
            r = tl.arange(0, STEP).to(tl.int64)
            c = tl.arange(0, BLOCK).to(tl.int64)
            nr = rows - ti * BLOCK
            nc = ncols - tj * BLOCK
            x_at = src + off + ti * BLOCK * s0 + tj * BLOCK * s1
            out_at = dst + codes_at + ti * BLOCK * ncols + tj * BLOCK
            c = c * s1
        if STEP == BLOCK:
            inside = (r[:, None] < nr) & (tl.arange(0, BLOCK)[None, :] < nc)
            x = tl.load(x_at + r[:, None] * s0 + c[None, :], mask=inside, other=0.0)
            amax_bits = _amax_bits(x)
        else:
            amax_bits = tl.full((), 0, tl.int32)
            for k in tl.range(0, BLOCK, STEP):
                rk = r + k
                inside = (rk[:, None] < nr) & (tl.arange(0, BLOCK)[None, :] < nc)
                x = tl.load(x_at + rk[:, None] * s0 + c[None, :], mask=inside, other=0.0)
                amax_bits = tl.maximum(amax_bits, _amax_bits(x))
        amax = amax_bits.to(tl.float32, bitcast=True)
        floor = tl.full((), 1e-4, tl.float32)
        scale = tl.math.div_rn(tl.maximum(amax, floor), tl.full((), 448.0, tl.float32))
        scale = tl.where(amax_bits > 0x7F800000, float("nan"), scale)
        fast = amax_bits < 0x67800000  # finite and below 2**80
        if scales_at >= 0:  # four bytes: a scale's offset is only 4-aligned in staging
            sbits = scale.to(tl.int32, bitcast=True)
            k4 = tl.arange(0, 4)
            sb = ((sbits >> (k4 * 8)) & 0xFF).to(tl.uint8)
            tl.store(dst + scales_at + (ti * ((ncols + BLOCK - 1) // BLOCK) + tj) * 4 + k4, sb)
        if codes_at >= 0:
            cc = tl.arange(0, BLOCK)
            if STEP == BLOCK and FINITE:
                if fast:  # the tile kept in registers, the short code path
                    res = _codes_finite(x.to(tl.float32), scale, HW_CVT)
                    out = out_at + (r[:, None] * ncols + cc[None, :])
                    tl.store(out, res.to(tl.uint8), mask=inside)
                else:  # inf, NaN or huge: the IEEE division, re-read in slices (from L2)
                    _code_rows(
                        x_at, out_at, s0, c, nr, nc, ncols, scale, fast, SLICE, BLOCK, HW_CVT, False
                    )
            elif STEP == BLOCK:
                res = _codes(x.to(tl.float32), scale, fast, HW_CVT, FAST_DIV)
                out = out_at + (r[:, None] * ncols + cc[None, :])
                tl.store(out, res.to(tl.uint8), mask=inside)
            else:
                _code_rows(
                    x_at, out_at, s0, c, nr, nc, ncols, scale, fast, STEP, BLOCK, HW_CVT, FAST_DIV
                )

    quantize = _quantize  # its name (`_quantize`) is the kernel's, as profiles show it
