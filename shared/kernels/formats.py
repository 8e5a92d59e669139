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
    q -= (q * s - x) * inv (each residual q * s - x is exact in the fma). GPU only: the interpreter's
    fma rounds twice. Exact for normal operands and results: inv = RN(1/s), one correction makes q
    faithful, and a faithful q plus one correction is RN(x / s) (Markstein's theorem), so STEPS=2
    holds for every fp32 x; STEPS=1 was checked exhaustively for every x with an fp16 or bf16
    significand against every fp32 s significand (2**33 pairs; C fmaf against IEEE `/`, with the
    STEPS=1 and 2 sequences as well as bare x * inv as a control, which fails 27 %). Off that domain
    (x or x / s below ~2**-100) callers rely only on |q| staying that tiny with x's sign, which it does:
    written as q * s - x (not x - q * s), the residual of a zero or underflowed q keeps the sign."""
    q = x * inv
    for _ in tl.static_range(STEPS):
        q = tl.fma(tl.fma(q, s, x * -1.0), -inv, q)
    return q
