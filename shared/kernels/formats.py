"""KV format codes (constexpr switches shared by every kernel here) and the rounding helpers the
kernels share, written with integer operations so GPU and interpreter give the same bits."""
import triton
import triton.language as tl

FMT_FP32, FMT_FP16, FMT_BF16, FMT_E4M3, FMT_E5M2, FMT_INT8, FMT_INT4 = range(7)
FMT_CODES = {"fp32": FMT_FP32, "fp16": FMT_FP16, "bf16": FMT_BF16, "fp8_e4m3": FMT_E4M3,
             "fp8_e5m2": FMT_E5M2, "int8": FMT_INT8, "int4": FMT_INT4}


@triton.jit
def rint_even(y):
    """Round half-to-even for |y| < 2**22: adding 1.5 * 2**23 leaves no fraction bits."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16 rounding half-to-even with integer ops (Triton's interpreter truncates)."""
    b = x.to(tl.uint32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def fp16_round_scale(s):
    """A positive fp32 scale rounded through fp16, as `quant._round_scale` does."""
    s = tl.minimum(s, 65504.0).to(tl.float16).to(tl.float32)
    return tl.maximum(s, 5.960464477539063e-08)


@triton.jit
def div_rn_fma(x, s, inv, STEPS: tl.constexpr):
    """x / s rounded to nearest-even, the bits of `tl.math.div_rn(x, s)` signed zeros included, from
    inv = div_rn(1.0, s) computed once per scale: q = x * inv, then STEPS Markstein corrections
    q -= (q * s - x) * inv (the residual q * s - x is exact in an fma). GPU only: the interpreter's
    fma rounds twice. Exact for normal operands and results: one correction makes q faithful, and a
    faithful q plus one correction is RN(x / s) when inv = RN(1/s) (Markstein's theorem), so STEPS=2
    holds for every fp32 x; STEPS=1 was checked exhaustively for every x with an fp16 (so also bf16)
    significand against every fp32 s significand: 2**33 pairs, none off (C with fmaf against IEEE
    `/`, in tests/test_kernels_cache_write.py; bare x * inv misrounds 27 % of them). Below that
    domain (x or x / s under ~2**-100) q stays that tiny and keeps x's sign: the residual is written
    q * s - x, not x - q * s, so a zero or underflowed q does not turn -0 into +0. `x * -1.0` is a
    negation folded into the FFMA (Triton's `-x` is 0 - x, an extra FADD)."""
    q = x * inv
    for _ in tl.static_range(STEPS):
        q = tl.fma(tl.fma(q, s, x * -1.0), -inv, q)
    return q
