"""The register-direct INT4 decode kernel on the H200: correctness against the torch reference, then
timing beside SDPA and the tile kernel (decode_int4.py), every variant in one run.

    python3 benchmarks/int4_direct_check.py [--reps 20] [--variants default,nocap,cap128]

1. Relative L2 against TorchBackend on the same cache (int4 budget 2e-3): fp16 and bf16 models, GQA
   1/3/4/8, head_dim 64/128/256, blocks 16/32, ragged contexts with tails, forced splits (fused and
   second-launch reductions), pages >= 70,000 (byte offsets past 2**32).
2. Decode 64x4096, 16x16384, 256x1024, 8x32768 as benchmarks/kernels.py times them (CUDA graph of
   10 calls, median of replays): speedup against SDPA over contiguous fp16 K/V.
--split-sweep times forced split counts instead; --context-sweep one wave of programs at growing
contexts, for each of --variants (a program's fixed cost, and the streaming rate of the pages; with
--fixed-pool in one pool size); --pool-sweep each case's pages scattered over larger pools.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
import kernels as kb  # noqa: E402  (maps kvmesh to shared/ when needed; the timing method)

from kvmesh.kernels.decode_int4 import decode_int4  # noqa: E402
from kvmesh.kernels.decode_int4_direct import decode_int4_direct  # noqa: E402
from kvmesh.kernels.torch_ref import TorchBackend  # noqa: E402

VARIANTS = {"default": {}, "nocap": dict(maxnreg=None), "cap128": dict(maxnreg=128), "cap144": dict(maxnreg=144),
            "cap152": dict(maxnreg=152), "cap168": dict(maxnreg=168), "unfused": dict(fused=False), "nopf": dict(l2_prefetch=False),
            "tail_last": dict(tail_first=False), "l1na": dict(l1_no_allocate=True),
            "l1na_off": dict(l1_no_allocate=False), "registers": dict(ring=0),
            "ring2": dict(ring=2), "ring4": dict(ring=4)}
# and "mod_<name>[:k=v,...]": the kernel of kernels/_<name>_int4_direct.py with those integer keyword
# arguments (git-ignored copies: "mod_baseline" an earlier version, others an experiment)
TOL = 2e-3
log = kb.log


def correctness(name: str = "default") -> bool:
    """The grid above for one variant (a VARIANTS name or mod_<name>[:k=v,...])."""
    from test_kernels_attention import make_case, rel_l2

    fn, base = variant(name)

    ok = True
    lens = [0, 17, 1000, 3000, 64, 2049, 511, 129]
    grid = [(4, 128, 16, torch.float16), (1, 128, 16, torch.float16), (8, 64, 32, torch.float16),
            (3, 64, 16, torch.float16), (4, 128, 32, torch.bfloat16), (4, 256, 16, torch.float16)]
    for gqa, d, bs, dt in grid:
        runs = [({}, {}), ({}, dict(splits=7)), ({}, dict(splits=3)), ({}, dict(l2_prefetch=False)),
                ({}, dict(l2_prefetch=False, splits=3)), ({}, dict(tail_first=False)), ({}, dict(tail_first=False, splits=3)),
                ({}, dict(tail_first=False, splits=7, fused=False)), (dict(first_page=70_000, num_layers=1, layer=0), {}),
                ({}, dict(ring=0)), ({}, dict(ring=0, splits=3))]  # the register loads where the ring serves
        for extra, kw in runs:
            try:
                case = dict(kv_heads=8, device="cuda", model_dtype=dt, **extra)
                ls = [4000, 20, 1600] if extra else lens
                cache, meta, q, k, v = make_case("int4", gqa, d, bs, ls, [1] * len(ls), seed=gqa + d + bs, **case)
                layer = case.get("layer", 1)
                ref = TorchBackend().attend(cache, layer, q, k, v, meta, d ** -0.5)
                out = fn(cache, layer, q, k, v, meta, d ** -0.5, **{**base, **kw})
                err = rel_l2(out, ref)
                flag = "ok" if err <= TOL else "FAIL"
                ok &= err <= TOL
                log(f"  {flag} {name} gqa={gqa} D={d} bs={bs} {str(dt)[6:]} {extra or ''} {kw or ''}: rel L2 {err:.2e}")
            except Exception:
                ok = False
                log(f"  FAIL gqa={gqa} D={d} bs={bs} {dt} {extra} {kw}:\n{traceback.format_exc()}")
    return ok


def case_inputs(batch: int, ctx: int, reps: int):
    """One benchmark case as kernels.py draws it: (SDPA ms, int4 cache, metadata, q [B, H, D], new k, v)."""
    case = kb.decode_case(batch, ctx)
    t_sdpa, _ = kb.time_sdpa(case, reps)
    return (t_sdpa, *kb.decode_problem("int4", case))


def variant(name: str):
    """(decode function, keyword arguments) of a variant: a VARIANTS name, or mod_<name>[:k=v,...]."""
    if not name.startswith("mod_"):
        return decode_int4_direct, dict(VARIANTS[name])
    mod, _, opts = name[4:].partition(":")  # a copy beside the shipped kernel, for a side-by-side timing
    kw = {k: int(v) for k, v in (o.split("=") for o in opts.split(",") if o)}
    return importlib.import_module(f"kvmesh.kernels._{mod}_int4_direct").decode_int4_direct, kw


def timing(reps: int, variants: list[str]) -> list:
    rows = []
    for batch, ctx in kb.DECODE_CASES:
        t_sdpa, cache, meta, q, kn, vn = case_inputs(batch, ctx, reps)
        scale = kb.D ** -0.5
        ref = decode_int4(cache, 0, q, kn, vn, meta, scale)
        t_old = kb.time_ms(lambda: decode_int4(cache, 0, q, kn, vn, meta, scale), reps)
        rows.append((f"{batch}x{ctx}", "tile kernel", t_old, t_sdpa / t_old, 0.0))
        for name in variants:
            fn, kw = variant(name)
            try:
                out = fn(cache, 0, q, kn, vn, meta, scale, **kw)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                t = kb.time_ms(lambda: fn(cache, 0, q, kn, vn, meta, scale, **kw), reps)
                rows.append((f"{batch}x{ctx}", f"direct {name}", t, t_sdpa / t, err))
            except Exception:
                log(f"  {name} {batch}x{ctx} FAILED:\n{traceback.format_exc()}")
        for r in rows[-len(variants) - 1:]:
            log(f"  {r[0]:10s} {r[1]:16s} {r[2]:.4f} ms  {r[3]:.2f}x sdpa  (vs tile kernel {r[4]:.1e})")
        del cache
        torch.cuda.empty_cache()
    return rows


def split_sweep(reps: int, counts: list[int]) -> None:
    """Speedup vs SDPA of the shipped variant at forced split counts (and the launcher's choice)."""
    print("\n| case | " + " | ".join(f"{c} splits" for c in counts) + " | launcher |")
    print("|---" * (len(counts) + 2) + "|")
    for batch, ctx in kb.DECODE_CASES:
        t_sdpa, cache, meta, q, kn, vn = case_inputs(batch, ctx, reps)
        cells = []
        for c in counts + [None]:
            t = kb.time_ms(lambda: decode_int4_direct(cache, 0, q, kn, vn, meta, kb.D ** -0.5, splits=c), reps)
            cells.append(f"{t_sdpa / t:.2f}x")
        print(f"| {batch}x{ctx} | " + " | ".join(cells) + " |", flush=True)
        del cache
        torch.cuda.empty_cache()


def labels_of(variants: list[str]) -> list[str]:
    """The variants' row labels: a variant named twice is timed twice, its second run "name #2"."""
    return [v if variants.index(v) == i else f"{v} #{variants[:i + 1].count(v)}" for i, v in enumerate(variants)]


def pool_sweep(reps: int, factors: list[int], variants: list[str]) -> None:
    """Each case's pages scattered over pools `factors` times its size (the benchmark's pool is the
    case's own 0.32 GB; a serving engine's is tens of GB): speedup against SDPA for each variant."""
    print(f"\n| case | variant | {' | '.join(f'pool x{f}' for f in factors)} |\n|---|---{'|---' * len(factors)}|")
    for batch, ctx in kb.DECODE_CASES:
        case = kb.decode_case(batch, ctx)
        t_sdpa, _ = kb.time_sdpa(case, reps)
        labels = labels_of(variants)
        cells: dict = {label: [] for label in labels}
        for f in factors:
            cache, meta, q, kn, vn = kb.decode_problem("int4", case, pool_pages=f * case.n_pages)
            for name, label in zip(variants, labels):
                fn, kw = variant(name)
                cells[label].append(t_sdpa / kb.time_ms(lambda: fn(cache, 0, q, kn, vn, meta, kb.D ** -0.5, **kw), reps))
            del cache
            torch.cuda.empty_cache()
        for name, xs in cells.items():
            print(f"| {batch}x{ctx} | {name} | {' | '.join(f'{x:.2f}x' for x in xs)} |", flush=True)


def context_sweep(reps: int, contexts: list[int], variants: list[str], wave: int = 16, fixed_pool: bool = False) -> None:
    """One wave of programs (`wave` an SM: sequences x KV heads, one split each, each variant's own
    register cap; the ring holds 16 an SM, the register loads 12) at growing contexts: time = a fixed
    cost a program + the pages' bytes at a streaming rate (a least-squares line over the contexts of
    1,024 tokens and more), for each variant. The pool grows with the context, and a token costs more
    in a larger pool (eighteenth session); `fixed_pool`: every context's pages in the largest's pool."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = sms * wave // kb.KVH
    pool = batch * max(contexts) // kb.BS if fixed_pool else 0
    labels = labels_of(variants)
    times: dict = {label: [] for label in labels}  # a variant named twice is timed and fitted twice
    for ctx in contexts:
        cache, meta, q, kn, vn = kb.decode_problem("int4", kb.decode_case(batch, ctx), pool_pages=pool)
        for name, label in zip(variants, labels):
            fn, kw = variant(name)
            kw = dict(kw, splits=1)
            t = kb.time_ms(lambda: fn(cache, 0, q, kn, vn, meta, kb.D ** -0.5, **kw), reps)
            times[label].append(t * 1000)
            log(f"  {name} {batch} x {ctx}: {t * 1000:.1f} us")
        page_head_bytes = cache.layout.layer_bytes // kb.KVH  # a head's share of a page (one layer)
        del cache
        torch.cuda.empty_cache()
    print(f"\n| variant | {' | '.join(str(c) for c in contexts)} | TB/s | fixed us |\n|---{'|---' * (len(contexts) + 2)}|")
    for name, ts in times.items():
        fit = [(c, t) for c, t in zip(contexts, ts) if c >= 1024] or list(zip(contexts, ts))
        mc, mt = sum(c for c, _ in fit) / len(fit), sum(t for _, t in fit) / len(fit)
        per_token = (sum((c - mc) * (t - mt) for c, t in fit) / max(sum((c - mc) ** 2 for c, _ in fit), 1e-9))  # us
        tbs = batch * kb.KVH * page_head_bytes / kb.BS / per_token / 1e6
        print(f"| {name} ({batch} x {kb.KVH} programs, us) | {' | '.join(f'{t:.1f}' for t in ts)} | {tbs:.2f} | "
              f"{mt - per_token * mc:.1f} |")
    print("(TB/s: page bytes streamed; fixed: a program's fixed cost, least squares over contexts >= 1024)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="default,nocap,cap128,unfused",
                    help="comma-separated, or ';'-separated when a variant takes several k=v (mod_x:a=1,b=2)")
    ap.add_argument("--check", default="default", help="';'-separated variants the correctness grid runs")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--split-sweep", default="", help="e.g. 1,2,3,4,8: time these split counts instead")
    ap.add_argument("--context-sweep", default="", help="e.g. 16,256,1024,2048,4096: a wave's fixed cost and rate")
    ap.add_argument("--wave", type=int, default=16, help="--context-sweep: programs an SM in its one wave")
    ap.add_argument("--fixed-pool", action="store_true", help="--context-sweep: one pool size for every context")
    ap.add_argument("--pool-sweep", default="", help="e.g. 1,4,16: each case's pages over pools that many times its size")
    args = ap.parse_args()
    variants = args.variants.split(";" if ";" in args.variants else ",")
    if args.context_sweep:
        context_sweep(args.reps, [int(c) for c in args.context_sweep.split(",")], variants, args.wave, args.fixed_pool)
        return
    if args.pool_sweep:
        pool_sweep(args.reps, [int(f) for f in args.pool_sweep.split(",")], variants)
        return
    if args.split_sweep:
        split_sweep(args.reps, [int(c) for c in args.split_sweep.split(",")])
        return
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    ok = args.skip_correctness or all([correctness(name) for name in args.check.split(";")])
    rows = timing(args.reps, variants)
    print("\n| case | kernel | ms | x SDPA | rel. diff vs tile kernel |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.4f} | {r[3]:.2f}x | {r[4]:.1e} |")
    print("correctness:", "all within 2e-3" if ok else "FAILURES above")


if __name__ == "__main__":
    main()
