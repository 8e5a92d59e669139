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
