"""The AVX-512 kernels of the CPU serving path's native library, compiled where the CPU has
AVX-512F and AVX512-BF16 (`native_source.py` puts them in the library's source and routes its entry
points here; other CPUs and shapes take the portable kernels). Same math as the portable kernels,
summed in another order.
"""

# Decode attention with AVX-512 (same arguments and math as the portable kernel, summed in another
# order). Per (sequence, KV head) the keys' row pointers are listed once (padded to a multiple of 16
# with the last key, whose score is real, so maxima stay exact) and up to RB query heads of the
# group share every loaded row. Scores: 16 keys at a time, one dot-product chain per key and head
# (bf16: vdpbf16ps on the stored pairs, no conversion; products exact, sums in float32), the 16
# partial vectors summed by a transposing tree instead of a horizontal sum per key. Probabilities
# times values in float32, every head's accumulators in registers over all value rows (the portable
# kernel loads and converts each value row once per head). Software prefetch of the next block of
# keys and of this block's values (SmolLM2 bf16 batch 32, in the model: 10.6 -> ~8 ms a step).
AVX512 = r"""
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVMESH_AVX512 1
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

/* prefetch rows [i0, i0 + 16) of `bytes` each (the next block of keys, this block of values):
   a sequence's rows lie in 2 KB runs, one per page, far apart */
#define pf16(rows, i0, bytes, hint)                                                                 \
    for (int64_t i_ = (i0); i_ < (i0) + 16; i_++)                                                   \
        for (int64_t c_ = 0; c_ < (bytes); c_ += 64) _mm_prefetch((const char*)(rows)[i_] + c_, hint)
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
        pf16((const void* const*)kr, b + 16 < npad ? b + 16 : b, NV * 16 * sizeof(T), _MM_HINT_T0);   \
        pf16((const void* const*)vr, b, NV * 16 * sizeof(T), _MM_HINT_T1);                           \
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

/* 16 float32 -> bf16 at p, as st_bf16: nearest even, NaN quieted */
static inline void st16_bf16(uint16_t* p, __m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

/* the portable kernels' arguments and math; dim % 16 and D % 32 left to them */
void kvmesh_portable_rms_norm_bf16(const uint16_t* x, int64_t xstride, const uint16_t* w, uint16_t* out,
                                   int64_t rows, int64_t dim, float eps);
void kvmesh_portable_rope_bf16(const uint16_t* x, int64_t xrow, int64_t heads, const uint16_t* cs,
                               const uint16_t* sn, uint16_t* out, int64_t orow, int64_t T, int64_t D);
static void fast_rms_norm_bf16(const uint16_t* x, int64_t xstride, const uint16_t* w, uint16_t* out,
                               int64_t rows, int64_t dim, float eps) {
    if (dim % 16) { kvmesh_portable_rms_norm_bf16(x, xstride, w, out, rows, dim, eps); return; }
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t* xr = x + i * xstride;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) { const __m512 v = v16_bf16(xr + d); ss = _mm512_fmadd_ps(v, v, ss); }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)dim + eps));
        for (int64_t d = 0; d < dim; d += 16)
            st16_bf16(out + i * dim + d, _mm512_mul_ps(v16_bf16(w + d), _mm512_mul_ps(v16_bf16(xr + d), inv)));
    }
}
static void fast_rope_bf16(const uint16_t* x, int64_t xrow, int64_t heads, const uint16_t* cs, const uint16_t* sn,
                           uint16_t* out, int64_t orow, int64_t T, int64_t D) {
    const int64_t half = D / 2;
    if (half % 16) { kvmesh_portable_rope_bf16(x, xrow, heads, cs, sn, out, orow, T, D); return; }
    for (int64_t t = 0; t < T; t++)
        for (int64_t d = 0; d < half; d += 16) {
            const __m512 c1 = v16_bf16(cs + t * D + d), c2 = v16_bf16(cs + t * D + d + half);
            const __m512 s1 = v16_bf16(sn + t * D + d), s2 = v16_bf16(sn + t * D + d + half);
            for (int64_t h = 0; h < heads; h++) {
                const uint16_t* xr = x + t * xrow + h * D;
                uint16_t* o = out + t * orow + h * D;
                const __m512 a = v16_bf16(xr + d), b = v16_bf16(xr + d + half);
                st16_bf16(o + d, _mm512_sub_ps(_mm512_mul_ps(a, c1), _mm512_mul_ps(b, s1)));
                st16_bf16(o + d + half, _mm512_add_ps(_mm512_mul_ps(b, c2), _mm512_mul_ps(a, s2)));
            }
        }
}

/* argmax rows: one pass for the maximum, one to its first index (usually early); a row with a NaN
   goes to the portable loop, which returns the first NaN as torch.max does */
#define DEFINE_FAST_ARGMAX(NAME, T, LD)                                                             \
static void NAME(const T* x, int64_t xstride, int64_t rows, int64_t n, int64_t* idx) {              \
    for (int64_t i = 0; i < rows; i++) {                                                            \
        const T* r = x + i * xstride;                                                               \
        if (n < 16) { idx[i] = argmax_row_##T(r, n); continue; }                                    \
        __m512 mv = v16_##T(r);                                                                     \
        __mmask16 nan = _mm512_cmp_ps_mask(mv, mv, _CMP_UNORD_Q);                                   \
        int64_t j = 16;                                                                             \
        for (; j + 16 <= n; j += 16) {                                                              \
            const __m512 v = v16_##T(r + j);                                                        \
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                          \
            mv = _mm512_max_ps(mv, v);                                                              \
        }                                                                                           \
        float m = _mm512_reduce_max_ps(mv);                                                         \
        for (; j < n; j++) { const float v = LD(r + j); nan |= v != v; m = v > m ? v : m; }         \
        if (nan) { idx[i] = argmax_row_##T(r, n); continue; }                                       \
        const __m512 mm = _mm512_set1_ps(m);                                                        \
        int64_t best = -1;                                                                          \
        for (j = 0; j + 16 <= n && best < 0; j += 16) {                                             \
            const __mmask16 k = _mm512_cmp_ps_mask(v16_##T(r + j), mm, _CMP_EQ_OQ);                 \
            if (k) best = j + __builtin_ctz(k);                                                     \
        }                                                                                           \
        for (; j < n && best < 0; j++) if (LD(r + j) == m) best = j;                                \
        idx[i] = best;                                                                              \
    }                                                                                               \
}
DEFINE_FAST_ARGMAX(fast_argmax_f32, f32, ld_f32)
DEFINE_FAST_ARGMAX(fast_argmax_bf16, bf16, ld_bf16)
#endif
"""
