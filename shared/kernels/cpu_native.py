"""`NativeKernels`: the CPU serving path's small C library: decode attention straight from the
paged pool, the decode step's residual writes, and bf16 RMSNorm and RoPE.

Why: on the CPU, torch's decode attention over pages is bound by its copies, not its math. Per
layer it gathers every page of every sequence into a new tensor, converts it to float32 and runs
two batched matmuls of tiny matrices (SmolLM2 bf16, 32 sequences of ~110 tokens: ~1.1 ms a layer,
a third of a decode step). This kernel reads each key and value row where it lies (page, residual
slot, or the step's own new token), once, converts it in registers and keeps softmax and the
weighted sum in float32: two passes per (sequence, KV head), the R = H / KVH query heads of the
group sharing every loaded row.

RMSNorm (bf16): torch's `rms_norm` numerics (float32 inside, one rounding to bf16 at the end;
transformers rounds twice, before and after the weight, which measured further from the fp32
model: SmolLM2's worst logit error 1.54 against 0.57) in one pass over the row, where torch runs
bf16 `rms_norm` as about eight ops (2048 x 576: ~3 ms; 32 rows: ~100 us in the model).

RoPE (bf16): q and k rotated in one pass, float32 inside, one rounding (torch: cat, neg, two
multiplies and an add, each rounding to bf16).

Scope of the attention kernel: one new token per sequence; unquantized KV pages (bf16 or fp32 storage, the model dtype);
other cases stay on `TorchBackend`'s torch path. The library is compiled once per machine with the
system C compiler (`cc`, about a second) into the kvmesh cache directory, and loaded with ctypes;
no compiler, a failed build or KVMESH_NATIVE_DECODE=0 means no kernel (`load()` returns None) and
the torch path runs. Math: the same softmax(q·kᵀ·scale)·v as the torch path in float32, summed in
another order (differences ~1e-6 relative); bf16 output rounded to nearest even like torch.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float ld_f32(const float* p) { return *p; }
static inline float ld_bf16(const uint16_t* p) { uint32_t u = (uint32_t)(*p) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline void st_f32(float* p, float x) { *p = x; }
/* exp(x) for x <= 0 (softmax after the max is taken out), ~2 ulp: 2^n * p(r), r = x - n ln2 in
   two steps; plain arithmetic, so the loops that call it vectorize (libm's expf does not) */
static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = __builtin_roundf(x * 1.44269504f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale; memcpy(&scale, &bits, 4);
    return p * scale;
}
static inline void st_bf16(uint16_t* p, float x) {
    uint32_t u; memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { *p = (uint16_t)((u >> 16) | 0x40u); return; }  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even */
    *p = (uint16_t)(u >> 16);
}

/* One layer, one new token per sequence g (G of them). Strides in elements.
   q [G, H, D] (token rows qrow apart), knew/vnew [G, KVH, D] (rows krow / vrow apart), heads dense; out
   [G, H, D] contiguous. Page p of this layer: K at kp + p * page_stride,
   V at vp + p * page_stride, each [KVH, bs, D] contiguous. Residual slot s: K at rk + s * slot_stride,
   V at rv + s * slot_stride, each [KVH, bs, D]. Sequence g attends to its nfull[g] pages
   table[g * tstride + j], then ntail[g] residual rows of slot slots[g], then its own new token.
   DC: head_dim as a compile-time constant (64, 128: fully unrolled rows) or the runtime D. */
#define DEFINE_KERNEL(NAME, T, LD, ST, DC)                                                          \
static int NAME(const T* q, const T* knew, const T* vnew, const T* kp, const T* vp, int64_t page_stride, \
         const int64_t* table, int64_t tstride, const int64_t* nfull, const T* rk, const T* rv,     \
         int64_t slot_stride, const int64_t* slots, const int64_t* ntail, T* out, int64_t G,        \
         int64_t H, int64_t KVH, int64_t bs, int64_t D_, float scale, int64_t qrow, int64_t krow, int64_t vrow) {  \
    const int64_t D = DC, R = H / KVH;                                                              \
    int64_t maxlen = 0;                                                                             \
    for (int64_t g = 0; g < G; g++) {                                                               \
        int64_t n = nfull[g] * bs + ntail[g] + 1;                                                   \
        if (n > maxlen) maxlen = n;                                                                 \
    }                                                                                               \
    float* scores = (float*)malloc(sizeof(float) * (size_t)(R * maxlen + R * D + D + R));          \
    if (!scores) return 1;                                                                          \
    float* qf = scores + R * maxlen;                                                                \
    float* row = qf + R * D;                                                                        \
    float* mx = row + D;                                                                            \
    for (int64_t g = 0; g < G; g++) {                                                               \
        const int64_t nkeys = nfull[g] * bs + ntail[g] + 1;                                         \
        for (int64_t h = 0; h < KVH; h++) {                                                         \
            for (int64_t r = 0; r < R; r++)                                                         \
                for (int64_t d = 0; d < D; d++)                                                     \
                    qf[r * D + d] = LD(q + g * qrow + (h * R + r) * D + d) * scale;                 \
            /* pass 1: scores of every key (pages, residual tail, own token) for the R heads */     \
            for (int64_t r = 0; r < R; r++) mx[r] = -3.0e38f;                                       \
            int64_t t = 0;                                                                          \
            for (int64_t j = 0; j <= nfull[g] + 1; j++) {                                           \
                const T* base;                                                                      \
                int64_t rows;                                                                       \
                if (j < nfull[g]) { base = kp + table[g * tstride + j] * page_stride + h * bs * D; rows = bs; } \
                else if (j == nfull[g]) { base = rk + slots[g] * slot_stride + h * bs * D; rows = ntail[g]; } \
                else { base = knew + g * krow + h * D; rows = 1; }                                  \
                for (int64_t i = 0; i < rows; i++, t++) {                                           \
                    for (int64_t d = 0; d < D; d++) row[d] = LD(base + i * D + d);                  \
                    for (int64_t r = 0; r < R; r++) {                                               \
                        float s = 0.f;                                                              \
                        for (int64_t d = 0; d < D; d++) s += qf[r * D + d] * row[d];               \
                        scores[r * maxlen + t] = s;                                                 \
                        mx[r] = s > mx[r] ? s : mx[r];                                              \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            /* softmax, then probabilities times values, one query head at a time (its sum in     \
               registers) */                                                                        \
            for (int64_t r = 0; r < R; r++) {                                                       \
                float* sr = scores + r * maxlen;                                                    \
                const float m = mx[r];                                                              \
                float sum = 0.f;                                                                    \
                for (int64_t i = 0; i < nkeys; i++) { sr[i] = exp_neg(sr[i] - m); sum += sr[i]; }   \
                float acc[DC];                                                                      \
                for (int64_t d = 0; d < D; d++) acc[d] = 0.f;                                       \
                t = 0;                                                                              \
                for (int64_t j = 0; j <= nfull[g] + 1; j++) {                                       \
                    const T* base;                                                                  \
                    int64_t rows;                                                                   \
                    if (j < nfull[g]) { base = vp + table[g * tstride + j] * page_stride + h * bs * D; rows = bs; } \
                    else if (j == nfull[g]) { base = rv + slots[g] * slot_stride + h * bs * D; rows = ntail[g]; } \
                    else { base = vnew + g * vrow + h * D; rows = 1; }                              \
                    for (int64_t i = 0; i < rows; i++, t++) {                                       \
                        const float p = sr[t];                                                      \
                        for (int64_t d = 0; d < D; d++) acc[d] += p * LD(base + i * D + d);         \
                    }                                                                               \
                }                                                                                   \
                const float inv = 1.f / sum;                                                        \
                for (int64_t d = 0; d < D; d++) ST(out + (g * H + h * R + r) * D + d, acc[d] * inv); \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    free(scores);                                                                                   \
    return 0;                                                                                       \
}

#define DEFINE_DISPATCH(NAME, T)                                                                    \
DEFINE_KERNEL(NAME##_64, T, LD_##T, ST_##T, 64)                                                     \
DEFINE_KERNEL(NAME##_128, T, LD_##T, ST_##T, 128)                                                   \
DEFINE_KERNEL(NAME##_any, T, LD_##T, ST_##T, D_)                                                    \
int NAME(const T* q, const T* knew, const T* vnew, const T* kp, const T* vp, int64_t page_stride,   \
         const int64_t* table, int64_t tstride, const int64_t* nfull, const T* rk, const T* rv,     \
         int64_t slot_stride, const int64_t* slots, const int64_t* ntail, T* out, int64_t G,        \
         int64_t H, int64_t KVH, int64_t bs, int64_t D, float scale, int64_t qrow, int64_t krow, int64_t vrow) {   \
    if (D == 64) return NAME##_64(q, knew, vnew, kp, vp, page_stride, table, tstride, nfull, rk, rv, \
                                  slot_stride, slots, ntail, out, G, H, KVH, bs, D, scale, qrow, krow, vrow); \
    if (D == 128) return NAME##_128(q, knew, vnew, kp, vp, page_stride, table, tstride, nfull, rk, rv, \
                                    slot_stride, slots, ntail, out, G, H, KVH, bs, D, scale, qrow, krow, vrow); \
    if (D > 512) return 2;                                                                          \
    return NAME##_any(q, knew, vnew, kp, vp, page_stride, table, tstride, nfull, rk, rv,            \
                      slot_stride, slots, ntail, out, G, H, KVH, bs, D, scale, qrow, krow, vrow); \
}

typedef float f32;
typedef uint16_t bf16;
#define LD_f32 ld_f32
#define ST_f32 st_f32
#define LD_bf16 ld_bf16
#define ST_bf16 st_bf16
DEFINE_DISPATCH(kvmesh_decode_f32, f32)
DEFINE_DISPATCH(kvmesh_decode_bf16, bf16)

/* x, out [rows, dim] bf16 (rows at x + i * xstride, out contiguous), w [dim] bf16:
   out = bf16(w * x * rsqrt(mean(x^2) + eps)), float32 inside, one rounding (torch's rms_norm) */
void kvmesh_rms_norm_bf16(const uint16_t* x, int64_t xstride, const uint16_t* w, uint16_t* out,
                          int64_t rows, int64_t dim, float eps) {
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t* xr = x + i * xstride;
        float ss = 0.f;
        for (int64_t d = 0; d < dim; d++) { const float v = ld_bf16(xr + d); ss += v * v; }
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) st_bf16(out + i * dim + d, ld_bf16(w + d) * (ld_bf16(xr + d) * inv));
    }
}

/* residual rows: new token src[i] (k rows krow, v rows vrow apart, [KVH, D] dense) -> slot slot[i], offset
   off[i] of the residual K/V ([KVH, bs, D] per slot, slots slot_stride apart); elem bytes per value */
void kvmesh_residual_write(const char* k, const char* v, int64_t krow, int64_t vrow, char* rk, char* rv, int64_t slot_stride,
                           const int64_t* src, const int64_t* slot, const int64_t* off, int64_t m, int64_t KVH,
                           int64_t bs, int64_t D, int64_t elem) {
    const int64_t n = D * elem;
    for (int64_t i = 0; i < m; i++)
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t to = (slot[i] * slot_stride + (h * bs + off[i]) * D) * elem;
            memcpy(rk + to, k + (src[i] * krow + h * D) * elem, (size_t)n);
            memcpy(rv + to, v + (src[i] * vrow + h * D) * elem, (size_t)n);
        }
}

/* x [T, heads, D] bf16 (rows at x + t * xrow, heads contiguous), cos/sin [T, D] bf16, out [T, heads, D]:
   out = x * cos + rotate_half(x) * sin (HF's convention: first half pairs with second), float32
   inside, one rounding */
void kvmesh_rope_bf16(const uint16_t* x, int64_t xrow, int64_t heads, const uint16_t* cs, const uint16_t* sn,
                      uint16_t* out, int64_t T, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const uint16_t* c = cs + t * D;
        const uint16_t* s = sn + t * D;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t* xr = x + t * xrow + h * D;
            uint16_t* o = out + (t * heads + h) * D;
            for (int64_t d = 0; d < half; d++) {
                const float a = ld_bf16(xr + d), b = ld_bf16(xr + d + half);
                st_bf16(o + d, a * ld_bf16(c + d) - b * ld_bf16(s + d));
                st_bf16(o + d + half, b * ld_bf16(c + d + half) + a * ld_bf16(s + d + half));
            }
        }
    }
}
"""

# reassociation lets the compiler vectorize the dot products and sums; no -ffast-math (keeps
# inf / NaN semantics and expf exact to libm)
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math",
          "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast"]
_KINDS = {torch.float32: "kvmesh_decode_f32", torch.bfloat16: "kvmesh_decode_bf16"}
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _cache_dir() -> Path:
    env = os.environ.get("KVMESH_CACHE_DIR")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "kvmesh") / "native"


def _build() -> Path:
    """Compiles the library (once per source, flags and CPU) and returns its path."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    cpu = platform.processor() + platform.machine()
    try:
        with open("/proc/cpuinfo") as f:  # -march=native: the library is only good for this CPU
            cpu += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    key = hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, cpu]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"decode_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "decode.c"
        src.write_text(_SOURCE)
        lib = Path(tmp) / out.name
        r = subprocess.run([cc, *_FLAGS, str(src), "-o", str(lib), "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:500]}")
        os.replace(lib, out)  # atomic: a concurrent build by another process is harmless
    return out


class NativeKernels:
    """The loaded kernel; `attend` runs it for one layer."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {}
        for dtype, name in _KINDS.items():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [_P, _P, _P, _P, _P, _I, _P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I,
                           ctypes.c_float, _I, _I, _I]
            self._fns[dtype] = fn
        self._norm = lib.kvmesh_rms_norm_bf16
        self._norm.restype = None
        self._norm.argtypes = [_P, _I, _P, _P, _I, _I, ctypes.c_float]
        self._write = lib.kvmesh_residual_write
        self._write.restype = None
        self._write.argtypes = [_P, _P, _I, _I, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I]
        self._rope = lib.kvmesh_rope_bf16
        self._rope.restype = None
        self._rope.argtypes = [_P, _I, _I, _P, _P, _P, _I, _I]

    def residual_write(self, k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, rk: torch.Tensor,
                       rv: torch.Tensor, slot: torch.Tensor, off: torch.Tensor) -> None:
        """rk/rv[slot[i], :, off[i]] = k/v[src[i]]: k, v [T, KVH, D] (token rows may be strided, heads
        dense), rk/rv [S, KVH, bs, D] of k's dtype (one layer's residual slots), src/slot/off int64 [m]."""
        T, KVH, D = k.shape
        bs = rk.shape[2]
        if (k.stride()[1:] != (D, 1) or v.stride()[1:] != (D, 1) or rk.dtype != k.dtype or v.dtype != k.dtype
                or rk.stride() != rv.stride() or rk.stride()[1:] != (bs * D, D, 1)):
            raise ValueError("NativeKernels.residual_write: wants dense [KVH, D] rows of one dtype")
        for t in (src, slot, off):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError("NativeKernels.residual_write: index tensors must be contiguous int64")
        self._write(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), rk.data_ptr(), rv.data_ptr(), rk.stride(0),
                    src.data_ptr(), slot.data_ptr(), off.data_ptr(), src.numel(), KVH, bs, D, k.element_size())

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] bf16 (rows may be strided, heads dense), cos/sin [T, 1, D] bf16 -> rotated
        [T, heads, D] (`RotaryEmbedding.apply`, one rounding)."""
        T, heads, D = x.shape
        if x.dtype != torch.bfloat16 or x.stride()[1:] != (D, 1) or cos.dtype != torch.bfloat16 or D % 2:
            raise ValueError(f"NativeKernels.rope: wants bf16 [T, heads, D] with dense heads, got {x.dtype} "
                             f"{tuple(x.shape)} strides {x.stride()}")
        c, s = cos.reshape(T, D).contiguous(), sin.reshape(T, D).contiguous()
        out = torch.empty((T, heads, D), dtype=x.dtype)
        self._rope(x.data_ptr(), x.stride(0), heads, c.data_ptr(), s.data_ptr(), out.data_ptr(), T, D)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, dim] bf16 (rows may be strided), weight [dim] bf16 -> [T, dim] bf16."""
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"NativeKernels.rms_norm: wants bf16 [T, dim] rows, got {x.dtype} {tuple(x.shape)}")
        w = weight.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        self._norm(x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], float(eps))
        return out

    @staticmethod
    def supports(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether it runs a model of `dtype` over pages stored as `kv_dtype` (unquantized only)."""
        return dtype == kv_dtype and dtype in _KINDS

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kpages: torch.Tensor,
               vpages: torch.Tensor, table: torch.Tensor, nfull: torch.Tensor, rk: torch.Tensor,
               rv: torch.Tensor, slots: torch.Tensor, ntail: torch.Tensor, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """q [G, H, D], k/v [G, KVH, D] (this step's tokens; token rows may be strided, as slices
        of the fused qkv are); kpages/vpages [N, KVH, bs, D] (one layer's pages, rows may be
        strided); table int64 [G, >= max nfull]; nfull, ntail, slots int64 [G]; rk/rv
        [S, KVH, bs, D] (one layer's residual slots) -> out [G, H, D] (contiguous; given or new)."""
        G, H, D = q.shape
        KVH, bs = kpages.shape[1], kpages.shape[2]
        fn = self._fns[q.dtype]
        if q.stride()[1:] != (D, 1):
            q = q.contiguous()
        if k.stride()[1:] != (D, 1):
            k = k.contiguous()
        if v.stride()[1:] != (D, 1):
            v = v.contiguous()
        for t in (kpages, vpages, rk, rv):  # rows of [KVH, bs, D] must be dense
            if t.dtype != q.dtype or t.stride()[1:] != (bs * D, D, 1):
                raise ValueError(f"NativeKernels: cache view {tuple(t.shape)} {t.dtype} strides {t.stride()}")
        if kpages.stride(0) != vpages.stride(0) or rk.stride(0) != rv.stride(0):
            raise ValueError("NativeKernels: K and V views must share their page / slot strides")
        for t in (table, nfull, slots, ntail):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError("NativeKernels: index tensors must be contiguous int64")
        if out is None:
            out = torch.empty((G, H, D), dtype=q.dtype)
        elif out.shape != (G, H, D) or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(f"NativeKernels.attend: out must be contiguous {q.dtype} {(G, H, D)}")
        rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), kpages.data_ptr(), vpages.data_ptr(), kpages.stride(0),
                table.data_ptr(), table.stride(0) if table.dim() == 2 else 0, nfull.data_ptr(), rk.data_ptr(),
                rv.data_ptr(), rk.stride(0), slots.data_ptr(), ntail.data_ptr(), out.data_ptr(), G, H, KVH, bs, D,
                float(scale), q.stride(0), k.stride(0), v.stride(0))
        if rc == 2:
            raise ValueError(f"NativeKernels.attend: head_dim {D} > 512")
        if rc != 0:
            raise MemoryError("NativeKernels: out of memory for the score buffer")
        return out


@functools.lru_cache(maxsize=1)
def load() -> NativeKernels | None:
    """The kernel, built on first use; None where it cannot be (the torch path runs instead)."""
    if os.environ.get("KVMESH_NATIVE_DECODE", "1") == "0":
        return None
    try:
        return NativeKernels(ctypes.CDLL(str(_build())))
    except (OSError, RuntimeError, AttributeError) as e:
        log.warning("native CPU decode attention unavailable, using torch: %s", e)
        return None
