"""Register-direct decode kernel (shared/kernels/decode_direct.py) variants against the plain Triton
decode kernel and SDPA over contiguous fp16, on the H200, in one run:

    python3 benchmarks/decode_direct_sweep.py [--reps 20] [--dtypes fp8_e4m3,fp8_e5m2,int8]

Same cases, data and timing as benchmarks/kernels.py (CUDA-graph replays, CUDA events, median). Each
variant is first checked against the plain kernel on the same cache (relative L2), so a fast wrong
variant shows as wrong. Variants: the launcher's own choice ("default"), the split reduction fused
into the last split or not, half or twice the launcher's split count, a bf16 model (q, new K/V and
residual tails in bf16; checked against the plain kernel on its own bf16 cache). Earlier variants (scores
untransposed, no prefetch, L2 prefetch, lazy rescaling, register caps) and their numbers:
docs/decode_direct.md.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

import kernels as kb  # benchmarks/kernels.py (puts kvmesh on the path too)
from kvmesh.kernels.decode_attention import decode_attention
from kvmesh.kernels.decode_direct import decode_direct
from kvmesh.kernels.splits import num_sms, num_splits

VARIANTS = [dict(), dict(fused=False), dict(fused=True), dict(split_scale=0.5), dict(split_scale=2),
            dict(bf16=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtypes", default="fp8_e4m3,fp8_e5m2,int8")
    ap.add_argument("--cases", default=None, help="indices into kernels.DECODE_CASES")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    t0 = time.time()
    cases = kb.DECODE_CASES if args.cases is None else [kb.DECODE_CASES[int(i)] for i in args.cases.split(",")]
    rows = []
    for batch, ctx in cases:
        dc = kb.decode_case(batch, ctx)
        n_pages, k_rows, v_rows, perm, qs, g = dc.n_pages, dc.k_rows, dc.v_rows, dc.perm, dc.qs, dc.gen
        t_sdpa, _ = kb.time_sdpa(dc, args.reps)
        kb.log(f"{batch}x{ctx}: sdpa {t_sdpa:.3f} ms ({time.time() - t0:.0f} s)")
        q = qs[:, :, 0].contiguous()
        kn = torch.randn(batch, kb.KVH, kb.D, device="cuda", dtype=torch.float16, generator=g)
        vn = torch.randn(batch, kb.KVH, kb.D, device="cuda", dtype=torch.float16, generator=g)
        scale = kb.D ** -0.5
        for kv in args.dtypes.split(","):
            cache = kb.filled_cache(kv, k_rows, v_rows, n_pages, perm)
            meta = kb.decode_meta(batch, ctx, perm, cache.layout)
            cache_bf = kb.filled_cache(kv, k_rows, v_rows, n_pages, perm, torch.bfloat16)
            qb, knb, vnb = q.bfloat16(), kn.bfloat16(), vn.bfloat16()
            ref_bf = decode_attention(cache_bf, 0, qb, knb, vnb, meta, scale, direct=False)
            ideal = 16 / (8 * cache.layout.bytes_per_token / (2 * kb.KVH * kb.D))
            ref = decode_attention(cache, 0, q, kn, vn, meta, scale, direct=False)
            t = kb.time_ms(lambda: decode_attention(cache, 0, q, kn, vn, meta, scale, direct=False), args.reps)
            rows.append((f"{batch}x{ctx}", kv, "plain triton", t, t_sdpa / t, ideal, 0.0))
            kb.log(f"  {kv} plain: {t:.3f} ms {t_sdpa / t:.2f}x")
            for var in VARIANTS:
                name = ",".join(f"{k}={v}" for k, v in var.items()) or "default"
                try:
                    kw, splits = dict(var), None
                    c, qq, kk, vv, r = cache, q, kn, vn, ref
                    if kw.pop("bf16", False):
                        c, qq, kk, vv, r = cache_bf, qb, knb, vnb, ref_bf
                    if "split_scale" in kw:  # relative to the launcher's count (16 programs per SM)
                        auto = num_splits(batch, kb.KVH, ctx + 1, num_sms(q.device), 16, 16)
                        splits = max(1, int(auto * kw.pop("split_scale")))
                        name += f" ({splits} splits)"
                    out = decode_direct(c, 0, qq, kk, vv, meta, scale, splits=splits, **kw)
                    err = ((out.float() - r.float()).norm() / r.float().norm()).item()
                    t = kb.time_ms(lambda: decode_direct(c, 0, qq, kk, vv, meta, scale, splits=splits, **kw),
                                   args.reps)
                    rows.append((f"{batch}x{ctx}", kv, name, t, t_sdpa / t, ideal, err))
                    kb.log(f"  {kv} {name}: {t:.3f} ms {t_sdpa / t:.2f}x (err vs plain {err:.1e})")
                except Exception:
                    kb.log(f"  {kv} {name} FAILED:\n{traceback.format_exc()}")
            del cache, cache_bf
            torch.cuda.empty_cache()
    print("\n| case | kv | kernel | ms | vs SDPA | ideal | rel. L2 vs plain |\n|---|---|---|---|---|---|---|")
    for case, kv, name, t, sp, ideal, err in rows:
        print(f"| {case} | {kv} | {name} | {t:.3f} | {sp:.2f}x | {ideal:.2f}x | {err:.1e} |")
    print(f"total {time.time() - t0:.0f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
