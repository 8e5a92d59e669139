"""The AMX bf16 linear of the CPU serving path's native library: y = op(x Wᵀ + b) for the few rows
of a decode step, over a weight packed once into AMX tiles.

Why: a decode step streams every weight once (SmolLM2 bf16: 268 MB a step) and at 1-64 rows the
GEMM is bound by that stream, not by math. oneDNN's packed bf16 linear reaches ~5-10 GB/s of a
core's ~14 there; this kernel keeps one stream per weight, in the order the tiles are used, and asks
for the next column pair's tiles into L2 while the current pair computes (measured one thread, cold
weights, 32 rows: 11-14 GB/s against oneDNN's 4-9 GB/s on the same shapes, best of noisy runs).

Layout: W [N, K] becomes N/16 column blocks of K/32 tiles, each tile [16 k-pairs][16 columns][2]
(the B operand of TDPBF16PS), a column block's tiles contiguous. Per pair of column blocks and 32
rows: two A tiles (x, rows xstride apart), two B tiles, four accumulator tiles over the K loop; the
epilogue adds the bias, then op: 0 plain, 1 + other (the residual add), 2 silu(gate) * up over
W = [G; U] (the gated MLP's first half: gate block p pairs with up block p + N/32). float32 inside
and one rounding to bf16 (nearest even), as oneDNN's epilogues; op 2 rounds silu(gate) to bf16
before the product, as the two oneDNN GEMMs it replaces do (one rounding less measured worse on
SmolLM2's first prompt position, where activations are largest: worst |Δ logit| against fp32 1.48
against 0.49). TDPBF16PS sums in the same K order as oneDNN at up to 32 rows: plain and residual
outputs were bit-identical to `F.linear` / oneDNN on every shape tried, and a row's result does not
depend on how many rows run with it.

Compiled only where the compiler targets AMX-BF16 and AVX-512 on Linux (the tile state needs
arch_prctl); elsewhere `kvmesh_amx_init` reports 1 and the callers keep oneDNN.
"""

AMX = r"""
#if defined(KVMESH_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

/* exp(x) for x <= 0, exp_neg's polynomial on 16 lanes */
static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
/* silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) so that nothing overflows */
static inline __m512 silu16(__m512 g) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __m512 num = _mm512_mask_mov_ps(one, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), e);
    return _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e)));
}

/* x rounded to bf16 (nearest even; finite inputs), kept in float32 */
static inline __m512 round16_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

/* asks Linux for the AMX tile state (once per process is enough; repeating is harmless): 0 = ready */
int kvmesh_amx_init(void) { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) ? 1 : 0; }

/* w [N, K] bf16 (rows K apart) -> out [N/16][K/32][16][16][2]; N % 16 == 0, K % 32 == 0 */
void kvmesh_amx_pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
    const int64_t KB = K / 32;
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t kb = 0; kb < KB; kb++) {
            uint16_t* t = out + (nb * KB + kb) * 512;
            for (int j = 0; j < 16; j++)
                for (int c = 0; c < 16; c++) {
                    t[j * 32 + c * 2] = w[(nb * 16 + c) * K + kb * 32 + 2 * j];
                    t[j * 32 + c * 2 + 1] = w[(nb * 16 + c) * K + kb * 32 + 2 * j + 1];
                }
        }
}

static void amx_config(int64_t m0, int64_t m1) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)m0;  /* accumulators and A of rows 0..15 */
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)m1;  /* ... of rows 16..31 */
    cfg.rows[6] = cfg.rows[7] = 16;                          /* the two B tiles */
    if (!m1) cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[5] = 0;
    _tile_loadconfig(&cfg);
}

/* out [M, N or N/2] bf16 (rows ostride apart) = op(x [M, K] (rows xstride apart) Wᵀ + bias), W packed
   by kvmesh_amx_pack; bias [N] or NULL; other [M, N] (rows other_stride apart) for op 1. Needs
   K % 32 == 0 and N % 32 == 0. */
void kvmesh_amx_linear(const uint16_t* x, int64_t xstride, const uint16_t* wp, const uint16_t* bias, int64_t N,
                       int64_t K, uint16_t* out, int64_t ostride, int64_t M, int op, const uint16_t* other,
                       int64_t other_stride) {
    const int64_t KB = K / 32, pairs = N / 32;
    float buf[4][256];
    int64_t cm0 = -1, cm1 = -1;
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t b0 = op == 2 ? p : 2 * p, b1 = op == 2 ? p + pairs : 2 * p + 1;
        const uint16_t* B0 = wp + b0 * KB * 512;
        const uint16_t* B1 = wp + b1 * KB * 512;
        const int64_t q = p + 1 < pairs ? p + 1 : p;  /* the next pair, whose tiles go to L2 now */
        const char* P0 = (const char*)(wp + (op == 2 ? q : 2 * q) * KB * 512);
        const char* P1 = (const char*)(wp + (op == 2 ? q + pairs : 2 * q + 1) * KB * 512);
        for (int64_t r0 = 0; r0 < M; r0 += 32) {
            const int64_t m0 = M - r0 < 16 ? M - r0 : 16, m1 = M - r0 - m0 < 16 ? M - r0 - m0 : 16;
            if (m0 != cm0 || m1 != cm1) { amx_config(m0, m1); cm0 = m0; cm1 = m1; }
            const uint16_t* xa = x + r0 * xstride;
            _tile_zero(0);
            _tile_zero(1);
            if (m1) { _tile_zero(2); _tile_zero(3); }
            for (int64_t kb = 0; kb < KB; kb++) {
                if (r0 == 0)
                    for (int c = 0; c < 1024; c += 64) {
                        _mm_prefetch(P0 + kb * 1024 + c, _MM_HINT_T1);
                        _mm_prefetch(P1 + kb * 1024 + c, _MM_HINT_T1);
                    }
                _tile_loadd(4, xa + kb * 32, xstride * 2);
                _tile_loadd(6, B0 + kb * 512, 64);
                _tile_loadd(7, B1 + kb * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (m1) {
                    _tile_loadd(5, xa + 16 * xstride + kb * 32, xstride * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, buf[0], 64);
            _tile_stored(1, buf[1], 64);
            if (m1) { _tile_stored(2, buf[2], 64); _tile_stored(3, buf[3], 64); }
            const __m512 bias0 = bias ? v16_bf16(bias + b0 * 16) : _mm512_setzero_ps();
            const __m512 bias1 = bias ? v16_bf16(bias + b1 * 16) : _mm512_setzero_ps();
            for (int64_t m = 0; m < m0 + m1; m++) {
                __m512 a = _mm512_add_ps(_mm512_loadu_ps(buf[m < 16 ? 0 : 2] + (m % 16) * 16), bias0);
                __m512 b = _mm512_add_ps(_mm512_loadu_ps(buf[m < 16 ? 1 : 3] + (m % 16) * 16), bias1);
                uint16_t* o = out + (r0 + m) * ostride;
                if (op == 2) { st16_bf16(o + p * 16, _mm512_mul_ps(round16_bf16(silu16(a)), b)); continue; }
                if (op == 1) {
                    const uint16_t* s = other + (r0 + m) * other_stride;
                    a = _mm512_add_ps(a, v16_bf16(s + b0 * 16));
                    b = _mm512_add_ps(b, v16_bf16(s + b1 * 16));
                }
                st16_bf16(o + b0 * 16, a);
                st16_bf16(o + b1 * 16, b);
            }
        }
    }
    _tile_release();
}
#else
int kvmesh_amx_init(void) { return 1; }
void kvmesh_amx_pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {}
void kvmesh_amx_linear(const uint16_t* x, int64_t xstride, const uint16_t* wp, const uint16_t* bias, int64_t N,
                       int64_t K, uint16_t* out, int64_t ostride, int64_t M, int op, const uint16_t* other,
                       int64_t other_stride) {}
#endif
"""
