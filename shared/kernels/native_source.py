"""The C source of the CPU serving path's native library (`cpu_native.py` builds and loads it):
decode attention over the paged pool, the decode step's residual writes, bf16 RMSNorm and RoPE.

Kept apart from the Python wrappers so each file stays one concept. Compiled with -march=native:
where the CPU has AVX-512 (with BF16), the exported entry points take the vectorized kernels of
`native_avx512.py` (decode attention for head_dim 32, 64 and 128, RMSNorm, RoPE); the portable
kernels here serve every other case and machine (and tests compare the two). `native_amx.py`: the
AMX bf16 linear for decode-sized row counts (no portable twin: without AMX, oneDNN serves);
`native_decode_layer.py`: a whole decoder layer of a decode step in one call, from these kernels.
"""

from kvmesh.kernels.native_amx import AMX
from kvmesh.kernels.native_avx512 import AVX512
from kvmesh.kernels.native_decode_layer import DECODE_LAYER

PORTABLE = r"""
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
/* round to nearest even; NaN stays NaN (quieted). Branch-free, so loops that store vectorize */
static inline void st_bf16(uint16_t* p, float x) {
    uint32_t u; memcpy(&u, &x, 4);
    const uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
    *p = (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u ? u | 0x400000u : r) >> 16);
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
DEFINE_DISPATCH(kvmesh_portable_decode_f32, f32)
DEFINE_DISPATCH(kvmesh_portable_decode_bf16, bf16)

/* x, out [rows, dim] bf16 (rows at x + i * xstride, out contiguous), w [dim] bf16:
   out = bf16(w * x * rsqrt(mean(x^2) + eps)), float32 inside, one rounding (torch's rms_norm) */
void kvmesh_portable_rms_norm_bf16(const uint16_t* x, int64_t xstride, const uint16_t* w, uint16_t* out,
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

/* x [T, heads, D] bf16 (rows at x + t * xrow, heads contiguous), cos/sin [T, D] bf16, out [T, heads, D]
   (rows orow apart; out may be x: each pair is read before it is written):
   out = x * cos + rotate_half(x) * sin (HF's convention: first half pairs with second), float32
   inside, one rounding */
void kvmesh_portable_rope_bf16(const uint16_t* x, int64_t xrow, int64_t heads, const uint16_t* cs, const uint16_t* sn,
                      uint16_t* out, int64_t orow, int64_t T, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const uint16_t* c = cs + t * D;
        const uint16_t* s = sn + t * D;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t* xr = x + t * xrow + h * D;
            uint16_t* o = out + t * orow + h * D;
            for (int64_t d = 0; d < half; d++) {
                const float a = ld_bf16(xr + d), b = ld_bf16(xr + d + half);
                st_bf16(o + d, a * ld_bf16(c + d) - b * ld_bf16(s + d));
                st_bf16(o + d + half, b * ld_bf16(c + d + half) + a * ld_bf16(s + d + half));
            }
        }
    }
}

/* first index of the maximum of x[0 .. n) (a NaN counts as the maximum, as torch.max) */
#define DEFINE_ARGMAX_ROW(NAME, T, LD)                                                              \
static int64_t NAME(const T* x, int64_t n) {                                                        \
    int64_t best = 0;                                                                               \
    float m = LD(x);                                                                                \
    if (m != m) return 0;                                                                           \
    for (int64_t j = 1; j < n; j++) {                                                               \
        const float v = LD(x + j);                                                                  \
        if (v != v) return j;                                                                       \
        if (v > m) { m = v; best = j; }                                                             \
    }                                                                                               \
    return best;                                                                                    \
}
DEFINE_ARGMAX_ROW(argmax_row_f32, f32, ld_f32)
DEFINE_ARGMAX_ROW(argmax_row_bf16, bf16, ld_bf16)
/* x [rows, n], rows xstride apart -> idx [rows] (greedy sampling) */
void kvmesh_portable_argmax_f32(const f32* x, int64_t xstride, int64_t rows, int64_t n, int64_t* idx) {
    for (int64_t i = 0; i < rows; i++) idx[i] = argmax_row_f32(x + i * xstride, n);
}
void kvmesh_portable_argmax_bf16(const bf16* x, int64_t xstride, int64_t rows, int64_t n, int64_t* idx) {
    for (int64_t i = 0; i < rows; i++) idx[i] = argmax_row_bf16(x + i * xstride, n);
}
"""

ENTRIES = r"""
#ifndef KVMESH_AVX512
#define FAST_D(D) 0
#define fast_decode_f32 kvmesh_portable_decode_f32
#define fast_decode_bf16 kvmesh_portable_decode_bf16
#define fast_rms_norm_bf16 kvmesh_portable_rms_norm_bf16
#define fast_rope_bf16 kvmesh_portable_rope_bf16
#define fast_argmax_f32 kvmesh_portable_argmax_f32
#define fast_argmax_bf16 kvmesh_portable_argmax_bf16
#endif


#define DEFINE_ENTRY(NAME, T)                                                                       \
int kvmesh_##NAME(const T* q, const T* knew, const T* vnew, const T* kp, const T* vp, int64_t page_stride, \
         const int64_t* table, int64_t tstride, const int64_t* nfull, const T* rk, const T* rv,     \
         int64_t slot_stride, const int64_t* slots, const int64_t* ntail, T* out, int64_t G,        \
         int64_t H, int64_t KVH, int64_t bs, int64_t D, float scale, int64_t qrow, int64_t krow, int64_t vrow) {   \
    return (FAST_D(D) ? fast_##NAME : kvmesh_portable_##NAME)(q, knew, vnew, kp, vp, page_stride, table, tstride, \
        nfull, rk, rv, slot_stride, slots, ntail, out, G, H, KVH, bs, D, scale, qrow, krow, vrow);  \
}
DEFINE_ENTRY(decode_f32, f32)
DEFINE_ENTRY(decode_bf16, bf16)
void kvmesh_rms_norm_bf16(const uint16_t* x, int64_t xstride, const uint16_t* w, uint16_t* out,
                          int64_t rows, int64_t dim, float eps) {
    fast_rms_norm_bf16(x, xstride, w, out, rows, dim, eps);
}
void kvmesh_rope_bf16(const uint16_t* x, int64_t xrow, int64_t heads, const uint16_t* cs, const uint16_t* sn,
                      uint16_t* out, int64_t orow, int64_t T, int64_t D) {
    fast_rope_bf16(x, xrow, heads, cs, sn, out, orow, T, D);
}
void kvmesh_argmax_f32(const f32* x, int64_t xstride, int64_t rows, int64_t n, int64_t* idx) {
    fast_argmax_f32(x, xstride, rows, n, idx);
}
void kvmesh_argmax_bf16(const bf16* x, int64_t xstride, int64_t rows, int64_t n, int64_t* idx) {
    fast_argmax_bf16(x, xstride, rows, n, idx);
}
"""

SOURCE = PORTABLE + AVX512 + AMX + ENTRIES + DECODE_LAYER
