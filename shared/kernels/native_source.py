"""The C source of the CPU serving path's native library (`cpu_native.py` builds and loads it):
decode attention over the paged pool, the decode step's residual writes, bf16 RMSNorm and RoPE.

Kept apart from the Python wrappers so each file stays one concept. Compiled with -march=native:
where the CPU has AVX-512, decode attention for head_dim 32, 64 and 128 takes the vectorized kernel
(`FAST_ATTENTION`); the portable kernel serves every other case and machine.
"""

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
DEFINE_DISPATCH(kvmesh_portable_decode_f32, f32)
DEFINE_DISPATCH(kvmesh_portable_decode_bf16, bf16)

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

# Decode attention with AVX-512 (same arguments and math as the portable kernel, summed in another
# order). Per (sequence, KV head) the keys' row pointers are listed once (padded to a multiple of 16
# with the last key, whose score is real, so maxima stay exact) and up to RB query heads of the
# group share every loaded row. Scores: 16 keys at a time, one dot-product chain per key and head
# (bf16: vdpbf16ps on the stored pairs, no conversion; products exact, sums in float32), the 16
# partial vectors summed by a transposing tree instead of a horizontal sum per key. Probabilities
# times values in float32, every head's accumulators in registers over all value rows (the portable
# kernel loads and converts each value row once per head).
FAST_ATTENTION = r"""
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
static inline __m512 v16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 v16_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
/* the transposing tree, four levels: lane i of red4(red3(red2(red1(v0, v1), red1(v2, v3)), ...)) is
   the sum of the 16 lanes of v_i */
static inline __m512 red1(__m512 a, __m512 b) { return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); }
static inline __m512 red2(__m512 a, __m512 b) {
    const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
static inline __m512 red3(__m512 a, __m512 b) { return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE)); }
static inline __m512 red4(__m512 a, __m512 b) { return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD)); }

/* q·k partial vectors: QV the query register type, QW elements per register */
#define QV_f32 __m512
#define QW_f32 16
#define QLD_f32(p) _mm512_loadu_ps(p)
#define DOT_f32(a, j, qv, p) a = (j) ? _mm512_fmadd_ps(qv, _mm512_loadu_ps(p), a) : _mm512_mul_ps(qv, _mm512_loadu_ps(p))
#define QV_bf16 __m512i
#define QW_bf16 32
#define QLD_bf16(p) _mm512_loadu_si512(p)
#define DOT_bf16(a, j, qv, p) a = _mm512_dpbf16_ps((j) ? a : _mm512_setzero_ps(), (__m512bh)(qv), (__m512bh)_mm512_loadu_si512(p))

/* RB heads of one group over n keys. q: RB rows of D (= NV * 16) values, unscaled; kr/vr: row
   pointers [npad]; sc [RB][npad] scratch; o [RB][D] float32, normalized. */
#define DEFINE_HEADS(NAME, T, NV, RB)                                                               \
static void NAME(const T* q, const T* const* kr, const T* const* vr, int64_t n, int64_t npad,      \
                 float scale, float* sc, float* o) {                                                \
    enum { QN = NV * 16 / QW_##T };                                                                 \
    QV_##T qv[RB][QN];                                                                              \
    for (int r = 0; r < RB; r++)                                                                    \
        for (int j = 0; j < QN; j++) qv[r][j] = QLD_##T(q + r * NV * 16 + j * QW_##T);              \
    const __m512 sv = _mm512_set1_ps(scale);                                                        \
    for (int64_t b = 0; b < npad; b += 16) {                                                        \
        __m512 u[RB][4];                                                                            \
        for (int c = 0; c < 4; c++) {  /* keys b + 4c .. b + 4c + 3 */                              \
            __m512 a[RB][4];                                                                        \
            for (int i = 0; i < 4; i++) {                                                           \
                const T* p = kr[b + 4 * c + i];                                                     \
                for (int r = 0; r < RB; r++)                                                        \
                    for (int j = 0; j < QN; j++) DOT_##T(a[r][i], j, qv[r][j], p + j * QW_##T);     \
            }                                                                                       \
            for (int r = 0; r < RB; r++) u[r][c] = red2(red1(a[r][0], a[r][1]), red1(a[r][2], a[r][3])); \
        }                                                                                           \
        for (int r = 0; r < RB; r++)                                                                \
            _mm512_storeu_ps(sc + r * npad + b,                                                     \
                             _mm512_mul_ps(red4(red3(u[r][0], u[r][1]), red3(u[r][2], u[r][3])), sv)); \
    }                                                                                               \
    float inv[RB];                                                                                  \
    for (int r = 0; r < RB; r++) {                                                                  \
        float* s = sc + r * npad;                                                                   \
        __m512 mv = _mm512_loadu_ps(s);                                                             \
        for (int64_t i = 16; i < npad; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));     \
        const float m = _mm512_reduce_max_ps(mv);                                                   \
        float sum = 0.f;                                                                            \
        for (int64_t i = 0; i < n; i++) { s[i] = exp_neg(s[i] - m); sum += s[i]; }                  \
        inv[r] = 1.f / sum;                                                                         \
    }                                                                                               \
    __m512 acc[RB][NV];                                                                             \
    for (int r = 0; r < RB; r++)                                                                    \
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_setzero_ps();                               \
    for (int64_t i = 0; i < n; i++) {                                                               \
        const T* p = vr[i];                                                                         \
        __m512 v[NV];                                                                               \
        for (int j = 0; j < NV; j++) v[j] = v16_##T(p + 16 * j);                                    \
        for (int r = 0; r < RB; r++) {                                                              \
            const __m512 pr = _mm512_set1_ps(sc[r * npad + i]);                                     \
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_fmadd_ps(pr, v[j], acc[r][j]);          \
        }                                                                                           \
    }                                                                                               \
    for (int r = 0; r < RB; r++)                                                                    \
        for (int j = 0; j < NV; j++)                                                                \
            _mm512_storeu_ps(o + (r * NV + j) * 16, _mm512_mul_ps(acc[r][j], _mm512_set1_ps(inv[r]))); \
}

typedef void (*heads_fn)(const void*, const void* const*, const void* const*, int64_t, int64_t, float, float*, float*);
#define DEFINE_FAST(NAME, T, ST)                                                                    \
DEFINE_HEADS(NAME##_2_1, T, 2, 1) DEFINE_HEADS(NAME##_2_2, T, 2, 2)                                \
DEFINE_HEADS(NAME##_2_3, T, 2, 3) DEFINE_HEADS(NAME##_2_4, T, 2, 4)                                \
DEFINE_HEADS(NAME##_4_1, T, 4, 1) DEFINE_HEADS(NAME##_4_2, T, 4, 2)                                \
DEFINE_HEADS(NAME##_4_3, T, 4, 3) DEFINE_HEADS(NAME##_4_4, T, 4, 4)                                \
DEFINE_HEADS(NAME##_8_1, T, 8, 1) DEFINE_HEADS(NAME##_8_2, T, 8, 2)                                \
static int NAME(const T* q, const T* knew, const T* vnew, const T* kp, const T* vp, int64_t page_stride, \
         const int64_t* table, int64_t tstride, const int64_t* nfull, const T* rk, const T* rv,     \
         int64_t slot_stride, const int64_t* slots, const int64_t* ntail, T* out, int64_t G,        \
         int64_t H, int64_t KVH, int64_t bs, int64_t D, float scale, int64_t qrow, int64_t krow, int64_t vrow) {  \
    const heads_fn fns[3][4] = {                                                                    \
        {(heads_fn)NAME##_2_1, (heads_fn)NAME##_2_2, (heads_fn)NAME##_2_3, (heads_fn)NAME##_2_4},   \
        {(heads_fn)NAME##_4_1, (heads_fn)NAME##_4_2, (heads_fn)NAME##_4_3, (heads_fn)NAME##_4_4},   \
        {(heads_fn)NAME##_8_1, (heads_fn)NAME##_8_2, 0, 0}};                                        \
    const int nv = D == 32 ? 0 : D == 64 ? 1 : 2, rbmax = D == 128 ? 2 : 4;                         \
    const int64_t R = H / KVH;                                                                      \
    int64_t maxlen = 0;                                                                             \
    for (int64_t g = 0; g < G; g++) {                                                               \
        const int64_t n = nfull[g] * bs + ntail[g] + 1;                                             \
        if (n > maxlen) maxlen = n;                                                                 \
    }                                                                                               \
    const int64_t maxpad = (maxlen + 15) / 16 * 16;                                                 \
    void* mem = malloc(sizeof(void*) * 2 * (size_t)maxpad + sizeof(float) * (size_t)(rbmax * (maxpad + D))); \
    if (!mem) return 1;                                                                             \
    const T** kr = (const T**)mem;                                                                  \
    const T** vr = kr + maxpad;                                                                     \
    float* sc = (float*)(vr + maxpad);                                                              \
    float* o = sc + rbmax * maxpad;                                                                 \
    for (int64_t g = 0; g < G; g++) {                                                               \
        const int64_t n = nfull[g] * bs + ntail[g] + 1, npad = (n + 15) / 16 * 16;                  \
        for (int64_t h = 0; h < KVH; h++) {                                                         \
            int64_t t = 0;                                                                          \
            for (int64_t j = 0; j < nfull[g]; j++) {                                                \
                const int64_t at = table[g * tstride + j] * page_stride + h * bs * D;               \
                for (int64_t i = 0; i < bs; i++, t++) { kr[t] = kp + at + i * D; vr[t] = vp + at + i * D; } \
            }                                                                                       \
            const int64_t at = slots[g] * slot_stride + h * bs * D;                                 \
            for (int64_t i = 0; i < ntail[g]; i++, t++) { kr[t] = rk + at + i * D; vr[t] = rv + at + i * D; } \
            for (; t < npad; t++) { kr[t] = knew + g * krow + h * D; vr[t] = vnew + g * vrow + h * D; } \
            for (int64_t r0 = 0; r0 < R; r0 += rbmax) {                                             \
                const int64_t rb = R - r0 < rbmax ? R - r0 : rbmax;                                 \
                fns[nv][rb - 1](q + g * qrow + (h * R + r0) * D, (const void* const*)kr,            \
                                (const void* const*)vr, n, npad, scale, sc, o);                     \
                for (int64_t r = 0; r < rb; r++)                                                    \
                    for (int64_t d = 0; d < D; d++) ST(out + (g * H + h * R + r0 + r) * D + d, o[r * D + d]); \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    free(mem);                                                                                      \
    return 0;                                                                                       \
}
DEFINE_FAST(fast_decode_f32, f32, st_f32)
DEFINE_FAST(fast_decode_bf16, bf16, st_bf16)
#define FAST_D(D) ((D) == 32 || (D) == 64 || (D) == 128)
#else
#define FAST_D(D) 0
#define fast_decode_f32 kvmesh_portable_decode_f32
#define fast_decode_bf16 kvmesh_portable_decode_bf16
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
"""

SOURCE = PORTABLE + FAST_ATTENTION
