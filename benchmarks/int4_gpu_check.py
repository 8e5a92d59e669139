"""INT4 kernels on the H200: correctness, then timing of the old and new cache write and decode.

    python3 benchmarks/int4_gpu_check.py [--reps 20] [--quick]

Needs `kvmesh` importable (the editable install, or benchmarks/gpu_check.sh's shim: kvmesh -> shared/;
without either, benchmarks/kernels.py maps it itself). Prints as it goes; about 2-3 minutes.
1. Write, byte-exact against quant.py computed on the CPU (true division): Llama-3-8B heads (KVH 8,
   D 128, bs 16) into the last 512 pages of a 70,016-page pool (byte offsets past 2**32), fp16, bf16 and
   fp32 rows (every (warps, heads per program, register cap) variant on fp16 rows); plus the tie-heavy blocks of
   tests/test_kernels_cache_write.py (fp32 rows next to code ties: catches an fma fused into the rounding).
2. Decode, relative L2 against TorchBackend on the same cache (int4 budget 2e-3): the four benchmark
   cases (exact pages), and ragged contexts with tails, 7 forced splits and pages >= 70,000
   (tests/test_kernels_attention.make_case), for every decode variant.
3. Timing as benchmarks/kernels.py does it (10 calls in a CUDA graph, replays between CUDA events,
   median): write 16,384 blocks (old = commit 7cb3417's kernel from benchmarks/int4_baseline/, new =
   each variant) as % of copy bandwidth; decode 64x4096, 16x16384, 256x1024, 8x32768 (old = the tile
   kernel in decode_attention.py, new = each decode_int4 variant) as speedup vs SDPA over contiguous fp16.
Ends with one table; "default" rows are what the library launches.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
import kernels as kb  # noqa: E402  (maps kvmesh to shared/ when needed; the timing method)

from kvmesh.kernels import decode_attention as da  # noqa: E402
from kvmesh.kernels.cache_write import INT4_MAXNREG, INT4_WARPS, int4_heads, write_blocks  # noqa: E402
from kvmesh.kernels.decode_int4 import decode_int4  # noqa: E402
from kvmesh.kernels.torch_ref import TorchBackend  # noqa: E402
from kvmesh.kv.layout import BlockLayout  # noqa: E402
from kvmesh.kv.pool import KVCache  # noqa: E402
from kvmesh.kv.quant import quantize_blocks, store_blocks  # noqa: E402

H, KVH, D, BS = kb.H, kb.KVH, kb.D, kb.BS
WRITE_VARIANTS = [(INT4_WARPS, None, -1), (1, 1, None), (2, 4, None), (4, 8, None), (2, 2, None), (4, 4, None),
                  (1, 2, 224), (1, 2, 168)]  # (warps, heads/program, maxnreg: -1 default, None none; caps spill)
DECODE_VARIANTS = {  # name -> decode_int4 options
    "default": {}, "no-asm": dict(asm=False), "no maxnreg": dict(maxnreg=None), "stages3": dict(num_stages=3),
    "2 streams": dict(pages=2, num_warps=2), "4 streams": dict(pages=4, num_warps=4),
    "4 streams st3": dict(pages=4, num_warps=4, num_stages=3),
}
ROWS: list = []  # (case, kernel, ms, TB/s, % of bandwidth, speedup vs SDPA, error)
log = kb.log


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def old_write_module():
    """Commit 7cb3417's int4 write (benchmarks/int4_baseline/), importable beside the new one."""
    d = Path(tempfile.mkdtemp(prefix="int4_baseline_"))
    base = ROOT / "benchmarks" / "int4_baseline"
    (d / "old_int4_codec.py").write_text((base / "int4_codec.py.txt").read_text())
    src = (base / "cache_write.py.txt").read_text()
    (d / "old_cache_write.py").write_text(src.replace("from kvmesh.kernels.int4_codec import", "from old_int4_codec import"))
    sys.path.insert(0, str(d))
    import old_cache_write
    return old_cache_write


def old_decode(*args):
    """decode_attention's own tile kernel for int4 (load_int4_tile), bypassing the int4 dispatch."""
    saved = da.FMT_INT4
    da.FMT_INT4 = -1
    try:
        return da.decode_attention(*args)
    finally:
        da.FMT_INT4 = saved


def variant_name(w, hp, mr, elem_bytes: int = 2) -> str:
    hp = hp or int4_heads(KVH, D, w, elem_bytes)
    regs = {None: "no maxnreg"}.get(INT4_MAXNREG if mr == -1 else mr, f"maxnreg {mr}")
    return f"{w} warp{'s' if w > 1 else ''}, {hp} heads/program, {regs}" + (" (default)" if (w, hp, mr) == (
        INT4_WARPS, int4_heads(KVH, D, INT4_WARPS, elem_bytes), -1) else "")


# ----------------------------------------------------------------------------- correctness

def check_write() -> None:
    layout = BlockLayout(num_layers=1, kv_heads=KVH, head_dim=D, block_size=BS, kv_dtype="int4")
    n_pages, n = 70_016, 512
    g = torch.Generator().manual_seed(3)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        k = (torch.randn(n * BS, KVH, D, generator=g) * 4 + torch.randn(D, generator=g) * 3).to(dt)
        v = torch.randn(n * BS, KVH, D, generator=g).to(dt)
        ref = KVCache(layout, n, 1, dt, "cpu")
        store_blocks(ref.layer_view(0), torch.arange(n), quantize_blocks(k.view(n, BS, KVH, D), v.view(n, BS, KVH, D), "int4"))
        got = KVCache(layout, n_pages, 1, dt, "cuda")
        rows = torch.arange(n * BS, device="cuda").view(n, BS) + BS  # all new rows
        ids = torch.arange(n_pages - n, n_pages, device="cuda")
        for w, hp, mr in WRITE_VARIANTS if dt == torch.float16 else WRITE_VARIANTS[:1]:  # compiles cost seconds
            try:
                got.pool.zero_()
                write_blocks(got, 0, k.cuda(), v.cuda(), rows, ids, num_warps=w, heads_per_program=hp, maxnreg=mr)
                diff = int((got.pool[-n:].cpu() != ref.pool).sum())
                log(f"  write {str(dt)[6:]:8s} {variant_name(w, hp, mr, k.element_size())}: "
                    + ("byte-exact" if diff == 0 else f"{diff} BYTES DIFFER"))
            except Exception:  # one failed variant costs one line
                log(f"  write {str(dt)[6:]} {variant_name(w, hp, mr)} FAILED:\n{traceback.format_exc()[-1500:]}")
    try:
        from test_kernels_cache_write import int4_hard_blocks
        k, v = int4_hard_blocks(torch.Generator().manual_seed(7))
        nb, bs, h, d = k.shape
        lay = BlockLayout(num_layers=1, kv_heads=h, head_dim=d, block_size=bs, kv_dtype="int4")
        ref = KVCache(lay, nb, 1, torch.float32, "cpu")
        store_blocks(ref.layer_view(0), torch.arange(nb), quantize_blocks(k, v, "int4"))
        for w, hp, mr in WRITE_VARIANTS[:2]:
            got = KVCache(lay, nb, 1, torch.float32, "cuda")
            write_blocks(got, 0, k.reshape(nb * bs, h, d).cuda(), v.reshape(nb * bs, h, d).cuda(),
                         torch.arange(nb * bs, device="cuda").view(nb, bs) + bs, torch.arange(nb, device="cuda"),
                         num_warps=w, heads_per_program=min(hp or h, h), maxnreg=mr)
            diff = int((got.pool.cpu() != ref.pool).sum())
            log(f"  write hard blocks (ties, fp32 rows) {w} warps, maxnreg {mr}: "
                + ("byte-exact" if diff == 0 else f"{diff} BYTES DIFFER"))
    except Exception:
        log(f"  hard blocks FAILED:\n{traceback.format_exc()}")


def check_decode_ragged() -> None:
    try:
        from test_kernels_attention import make_case
    except Exception as e:
        log(f"  ragged decode check skipped (tests/test_kernels_attention.py: {type(e).__name__}: {e})")
        return
    ragged = [0, 17, 1000, 3000, 64, 2049, 511, 129]
    for name, kw in DECODE_VARIANTS.items():
        errs = []
        for lens, case, extra in (
                (ragged, dict(kv_heads=8, device="cuda", seed=1), {}),
                (ragged, dict(kv_heads=8, device="cuda", seed=2), dict(splits=7)),
                ([4000, 20, 1600], dict(kv_heads=8, device="cuda", seed=3, first_page=70_000, num_layers=1, layer=0), {})):
            try:
                cache, meta, q, k, v = make_case("int4", 4, D, BS, lens, [1] * len(lens), **case)
                layer = case.get("layer", 1)
                ref = TorchBackend().attend(cache, layer, q, k, v, meta, D ** -0.5)
                errs.append(rel_l2(decode_int4(cache, layer, q, k, v, meta, D ** -0.5, **kw, **extra), ref))
            except Exception:
                log(f"  decode {name} FAILED:\n{traceback.format_exc()}")
                errs.append(math.nan)
        ok = all(e <= 2e-3 for e in errs)
        log(f"  decode ragged/splits 7/pages>=70000 {name:14s}: rel L2 " + ", ".join(f"{e:.1e}" for e in errs)
            + ("  ok" if ok else "  OVER 2e-3"))


# ----------------------------------------------------------------------------- timing

def bench_write(reps: int, copy_tbs: float) -> None:
    n_blocks = 16384
    g = torch.Generator(device="cuda").manual_seed(7)
    k = torch.randn(n_blocks * BS, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(n_blocks * BS, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    layout = BlockLayout(num_layers=1, kv_heads=KVH, head_dim=D, block_size=BS, kv_dtype="int4")
    cache = KVCache(layout, n_blocks, 1, torch.float16, "cuda")
    rows = torch.arange(n_blocks * BS, device="cuda").view(n_blocks, BS) + BS
    ids = torch.randperm(n_blocks, device="cuda", generator=g)
    nbytes = 2 * k.numel() * k.element_size() + n_blocks * layout.block_bytes + rows.numel() * 8
    fns = []
    try:
        old = old_write_module()
        fns.append(("old (7cb3417)", lambda: old.write_blocks(cache, 0, k, v, rows, ids)))
    except Exception:
        log(f"  old write unavailable:\n{traceback.format_exc()}")
    for w, hp, mr in WRITE_VARIANTS:
        fns.append((variant_name(w, hp, mr), lambda w=w, hp=hp, mr=mr: write_blocks(
            cache, 0, k, v, rows, ids, num_warps=w, heads_per_program=hp, maxnreg=mr)))
    for name, fn in fns:
        try:
            t = kb.time_ms(fn, reps)
            tbs = nbytes / t / 1e9
            ROWS.append(("write 16384 blocks", f"int4 write {name}", t, tbs, tbs / copy_tbs, math.nan, ""))
            log(f"  write {name}: {t:.3f} ms, {tbs:.2f} TB/s = {100 * tbs / copy_tbs:.0f}% of copy")
        except Exception:
            log(f"  write {name} FAILED:\n{traceback.format_exc()}")


def bench_decode(batch: int, ctx: int, reps: int, read_tbs: float, with_ref: bool) -> None:
    dc = kb.decode_case(batch, ctx)
    n_pages, perm, qs, g = dc.n_pages, dc.perm, dc.qs, dc.gen
    t_sdpa, _ = kb.time_sdpa(dc, reps)
    case = f"{batch}x{ctx}"
    ROWS.append((case, "sdpa fp16 contiguous", t_sdpa, math.nan, math.nan, 1.0, ""))
    cache = kb.filled_cache("int4", dc.k_rows, dc.v_rows, n_pages, perm)
    del dc
    meta = kb.decode_meta(batch, ctx, perm, cache.layout)
    q = qs[:, :, 0].contiguous()
    kn = torch.randn(batch, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    vn = torch.randn(batch, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    scale = D ** -0.5
    ref = TorchBackend().attend(cache, 0, q, kn, vn, meta, scale) if with_ref else None
    nbytes = n_pages * cache.layout.block_bytes + 2 * q.numel() * q.element_size()
    fns = [("old tile kernel", lambda: old_decode(cache, 0, q, kn, vn, meta, scale))]
    fns += [(f"new {n}", lambda kw=kw: decode_int4(cache, 0, q, kn, vn, meta, scale, **kw))
            for n, kw in DECODE_VARIANTS.items()]
    for name, fn in fns:
        try:
            err = "" if ref is None else f"{rel_l2(fn(), ref):.1e}"
            t = kb.time_ms(fn, reps)
            tbs = nbytes / t / 1e9
            ROWS.append((case, f"int4 {name}", t, tbs, tbs / read_tbs, t_sdpa / t, err))
            log(f"  {case} {name}: {t:.3f} ms  {t_sdpa / t:.2f}x sdpa  {tbs:.2f} TB/s  rel L2 {err or '-'}")
        except Exception:
            log(f"  {case} {name} FAILED:\n{traceback.format_exc()}")
    del cache
    torch.cuda.empty_cache()


def table(read_tbs: float, copy_tbs: float) -> str:
    out = [f"read {read_tbs:.2f} TB/s (torch.sum), copy {copy_tbs:.2f} TB/s; % column: decode of read, write of copy",
           "", "| case | kernel | ms | TB/s | % bw | vs SDPA | rel L2 |", "|---|---|---|---|---|---|---|"]
    for case, name, t, tbs, frac, sp, err in ROWS:
        f = lambda x, fmt: "" if x != x else fmt.format(x)  # noqa: E731 (NaN -> blank)
        out.append(f"| {case} | {name} | {t:.3f} | {f(tbs, '{:.2f}')} | {f(100 * frac, '{:.0f}%')} | "
                   f"{f(sp, '{:.2f}x')} | {err} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="two decode cases, no ragged check")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/int4_gpu_check.py needs a CUDA GPU")
    torch.set_grad_enabled(False)
    t0 = time.time()
    import triton
    log(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name(0)}")
    for title, part in (("write correctness", check_write), ("decode correctness, ragged", check_decode_ragged)):
        if args.quick and part is check_decode_ragged:
            continue
        log(f"== {title} ({time.time() - t0:.0f} s)")
        try:  # a failed part costs its lines, not the timing
            part()
        except Exception:
            log(f"  {title} FAILED:\n{traceback.format_exc()[-1500:]}")
    read_tbs, copy_tbs = kb.read_bandwidth(10)
    log(f"== timing ({time.time() - t0:.0f} s): read {read_tbs:.2f} TB/s, copy {copy_tbs:.2f} TB/s")
    bench_write(args.reps, copy_tbs)
    cases = kb.DECODE_CASES[:2] if args.quick else kb.DECODE_CASES
    for i, (batch, ctx) in enumerate(cases):
        if time.time() - t0 > 200:  # the 4-minute budget: later cases dropped, said so
            log(f"decode {batch}x{ctx} skipped: {time.time() - t0:.0f} s used")
            continue
        log(f"decode {batch}x{ctx} ({time.time() - t0:.0f} s)")
        try:
            bench_decode(batch, ctx, args.reps, read_tbs, with_ref=True)
        except Exception:
            log(f"decode {batch}x{ctx} FAILED:\n{traceback.format_exc()}")
        torch.cuda.empty_cache()
    log("\n" + table(read_tbs, copy_tbs))
    log(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
