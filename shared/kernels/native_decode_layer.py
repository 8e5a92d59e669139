"""One decoder layer of a bf16 decode step in one C call: the native library's kernels in the order
the Python layer calls them (`model/native_decode.py` drives it), so a decode step pays one ctypes
call a layer instead of ~10 torch and ctypes calls with their checks (SmolLM2, 32 sequences: ~80 µs
of Python a layer, a sixth of the step).

Same kernels, same arguments, same order as the unfused path, so the same bits: RMSNorm, the AMX
qkv linear (+ bias), RoPE on q and k in place, decode attention over pages + residual tail + own
token, then the step's cache write as `TorchBackend.write` does it for unquantized pages: the new
K/V row goes to its residual slot at offset prefix % bs, or, where it completes the block, the
residual rows and it are copied into the block's page; then o_proj with the residual add, RMSNorm,
silu(gate) * up, down_proj with the residual add, in place on x.
"""

DECODE_LAYER = r"""
/* x [T, hidden] bf16, the residual stream, updated in place. Weights: norm1/norm2 [hidden]; qkv, o,
   gate_up, down: AMX tiles (kvmesh_amx_pack) of [NQKV, hidden], [hidden, H * D], [2 * inter, hidden],
   [hidden, inter]; qkv_b [NQKV], o_b [hidden] or NULL. Cache of this layer: pages kp / vp (page p at
   + p * page_stride, [KVH, bs, D]), residual slots rk / rv (slot s at + s * slot_stride, [KVH, bs, D]).
   Step: table [T, tstride] page ids (each row covers its full blocks and the one its token completes),
   nfull / ntail / slots [T] (prefix // bs, prefix % bs, residual slot), cos / sin [T, D]. Scratch: h
   [T, hidden], qkv [T, NQKV], att [T, H * D], mlp [T, inter]. Returns 0, or the attention's error. */
int kvmesh_decode_layer(uint16_t* x, int64_t T, int64_t hidden, int64_t H, int64_t KVH, int64_t D, int64_t inter,
                        float eps, float scale, const uint16_t* norm1, const uint16_t* qkv_w, const uint16_t* qkv_b,
                        const uint16_t* o_w, const uint16_t* o_b, const uint16_t* norm2, const uint16_t* gu_w,
                        const uint16_t* down_w, uint16_t* kp, uint16_t* vp, int64_t page_stride, uint16_t* rk,
                        uint16_t* rv, int64_t slot_stride, int64_t bs, const int64_t* table, int64_t tstride,
                        const int64_t* nfull, const int64_t* ntail, const int64_t* slots, const uint16_t* cs,
                        const uint16_t* sn, uint16_t* h, uint16_t* qkv, uint16_t* att, uint16_t* mlp) {
    const int64_t NQKV = (H + 2 * KVH) * D;
    uint16_t* k = qkv + H * D;
    uint16_t* v = qkv + (H + KVH) * D;
    kvmesh_rms_norm_bf16(x, hidden, norm1, h, T, hidden, eps);
    kvmesh_amx_linear(h, hidden, qkv_w, qkv_b, NQKV, hidden, qkv, NQKV, T, 0, 0, 0);
    kvmesh_rope_bf16(qkv, NQKV, H + KVH, cs, sn, qkv, NQKV, T, D);
    const int rc = kvmesh_decode_bf16(qkv, k, v, kp, vp, page_stride, table, tstride, nfull, rk, rv, slot_stride,
                                      slots, ntail, att, T, H, KVH, bs, D, scale, NQKV, NQKV, NQKV);
    if (rc) return rc;
    const size_t row = (size_t)D * 2;
    for (int64_t g = 0; g < T; g++)
        for (int64_t j = 0; j < KVH; j++) {
            const uint16_t* kn = k + g * NQKV + j * D;
            const uint16_t* vn = v + g * NQKV + j * D;
            uint16_t* rkj = rk + slots[g] * slot_stride + j * bs * D;
            uint16_t* rvj = rv + slots[g] * slot_stride + j * bs * D;
            if (ntail[g] == bs - 1) {  /* the block completes: residual rows + this one into its page */
                const int64_t at = table[g * tstride + nfull[g]] * page_stride + j * bs * D;
                memcpy(kp + at, rkj, row * (size_t)(bs - 1));
                memcpy(vp + at, rvj, row * (size_t)(bs - 1));
                memcpy(kp + at + (bs - 1) * D, kn, row);
                memcpy(vp + at + (bs - 1) * D, vn, row);
            } else {
                memcpy(rkj + ntail[g] * D, kn, row);
                memcpy(rvj + ntail[g] * D, vn, row);
            }
        }
    kvmesh_amx_linear(att, H * D, o_w, o_b, hidden, H * D, x, hidden, T, 1, x, hidden);
    kvmesh_rms_norm_bf16(x, hidden, norm2, h, T, hidden, eps);
    kvmesh_amx_linear(h, hidden, gu_w, 0, 2 * inter, hidden, mlp, inter, T, 2, 0, 0);
    kvmesh_amx_linear(mlp, inter, down_w, 0, hidden, inter, x, hidden, T, 1, x, hidden);
    return 0;
}
"""
