"""Register-direct decode kernel (shared/kernels/decode_direct.py) variants against the plain Triton
decode kernel and SDPA over contiguous fp16, on the H200, in one run:

    python3 benchmarks/decode_direct_sweep.py [--reps 20] [--dtypes fp8_e4m3,int8,fp16] [--jobs 8]
        [--variants "default,heads first"]

Same cases, data and timing as benchmarks/kernels.py (CUDA-graph replays, CUDA events, median). Each
variant is first checked against the plain kernel on the same cache (relative L2), so a fast wrong
variant shows as wrong. `--jobs` compiles every variant first in that many worker processes (Triton's
on-disk cache then serves the timing process; the whole run takes about a minute). 8-bit pages: the
launcher's choice ("default") against the tail first or last, a bf16 model, and the format's
`PageLoads` with one field changed; 16-bit pages: the plain kernel, its own grid order and heads
first. The first variant of each dtype is timed again last (drift). Earlier variants (the cp.async ring,
16-bit pages in the direct kernel, PDL, fp16 partials, ...) and their numbers: docs/decode_direct.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import sys
import time
import traceback

import torch

import kernels as kb  # benchmarks/kernels.py (puts kvmesh on the path too)
from kvmesh.kernels.decode_attention import decode_attention
from kvmesh.kernels.decode_direct import LOADS, decode_direct
from kvmesh.kernels.formats import FMT_CODES

VARIANTS_8 = [("default", dict()), ("tail first", dict(tail_first=True)), ("tail last", dict(tail_first=False)),
              ("bf16 model", dict(bf16=True)),
              # the format's LOADS entry with one field changed (decode_direct.PageLoads)
              ("heads first", dict(loads_with=dict(heads_first=True))),
              ("l2 hint", dict(loads_with=dict(l2_prefetch=128))),
              ("l1 no-allocate", dict(loads_with=dict(l1_no_allocate=3))),
              ("l1 no-allocate k", dict(loads_with=dict(l1_no_allocate=1))),
              ("l1 no-allocate off", dict(loads_with=dict(l1_no_allocate=0)))]
VARIANTS_16 = [("plain", dict(plain=True, heads_first=False)),
               ("plain heads first", dict(plain=True, heads_first=True)),
               ("engine", dict(plain=True)),  # the format's own tile and choices
               ("two dots", dict(plain=True, lo_rows=False)),  # bf16: p . v as hi + lo dots, not lo rows
               ("lo rows", dict(plain=True, lo_rows=True)),  # bf16: lo rows at every case
               ("lo rows 32x5 cap128", dict(plain=True, lo_rows=True, block_n=32, num_stages=5, maxnreg=128)),
               ("lo rows 128x5", dict(plain=True, lo_rows=True, block_n=128, num_stages=5)),
               # one program an SM with the deepest pipeline (140 KB of shared memory): bf16's pick where a
               # launch fits one wave; for fp16 (one dot already) not yet timed
               ("128x5", dict(plain=True, lo_rows=False, block_n=128, num_stages=5))]
# tiles past one wave (256 x 1,024: 2,048 programs, no split), with the engine's early tail loads and
# heads-first grid there; "lo" also takes bf16's lo rows (fp16: the same as without)
for _tile, _extra in [((32, 3), dict(maxnreg=128)), ((32, 4), dict(maxnreg=128)), ((64, 3), {}),
                      ((64, 4), dict(maxnreg=128)), ((128, 2), {}), ((128, 3), {}), ((64, 2), {}),
                      ((64, 2), dict(maxnreg=128)), ((32, 2), {}), ((32, 2), dict(maxnreg=128)), ((64, 1), {}),
                      ((128, 1), {}), ((64, 3), dict(maxnreg=128))]:
    _name = f"{_tile[0]}x{_tile[1]}" + (" cap128" if _extra else "")
    _base = dict(plain=True, block_n=_tile[0], num_stages=_tile[1], tail_early=True, heads_first=True, **_extra)
    VARIANTS_16 += [(f"past-wave {_name}", dict(_base, lo_rows=False)),
                    (f"past-wave lo {_name}", dict(_base, lo_rows=True))]


def variants(kv: str, again: bool, names: list | None = None) -> list:
    """(name, variant) of one dtype, only `names` where given; `again`: the first once more at the end
    (drift)."""
    v = VARIANTS_16 if kv in ("fp16", "bf16") else VARIANTS_8
    v = [x for x in v if (names is None or x[0] in names) and not (kv != "bf16" and x[1].get("lo_rows")
                                                                     and x[0].startswith("past-wave"))]
    return v + [(v[0][0] + " again", v[0][1])] if again else v


def call_of(var: dict, p, scale: float):
    cache, meta, q, kn, vn = p
    kw = {k: v for k, v in var.items() if k not in ("plain", "bf16", "loads_with")}
    if "loads_with" in var:
        kw["loads"] = dataclasses.replace(LOADS[FMT_CODES[cache.layout.kv_dtype]], **var["loads_with"])
    if var.get("plain"):
        return lambda: decode_attention(cache, 0, q, kn, vn, meta, scale, direct=False, **kw)
    return lambda: decode_direct(cache, 0, q, kn, vn, meta, scale, **kw)


def run_case(batch: int, ctx: int, dtypes: list, reps: int, rows: list | None, names: list | None = None) -> None:
    """Every variant of every dtype at one case: checked against the plain kernel, then timed (rows
    None: called once each, to compile)."""
    t0 = time.time()
    dc = kb.decode_case(batch, ctx)
    t_sdpa = kb.time_sdpa(dc, reps)[0] if rows is not None else 1.0
    scale = kb.D ** -0.5
    for kv in dtypes:
        probs: dict = {}
        for name, var in variants(kv, rows is not None, names):
            try:
                model = torch.bfloat16 if (var.get("bf16") or kv == "bf16") else torch.float16
                if model not in probs:
                    p = kb.decode_problem(kv, dc, model)
                    cache, meta, q, kn, vn = p
                    probs[model] = (p, decode_attention(cache, 0, q, kn, vn, meta, scale, direct=False))
                p, ref = probs[model]
                fn = call_of(var, p, scale)
                out = fn()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if rows is None:
                    continue
                t = kb.time_ms(fn, reps)
                ideal = 16 / (8 * p[0].layout.bytes_per_token / (2 * kb.KVH * kb.D))
                rows.append((f"{batch}x{ctx}", kv, name, t, t_sdpa / t, ideal, err))
                kb.log(f"  {batch}x{ctx} {kv} {name}: {t:.4f} ms {t_sdpa / t:.3f}x (err vs plain {err:.1e})")
            except Exception:
                kb.log(f"  {batch}x{ctx} {kv} {name} FAILED:\n{traceback.format_exc()}")
        del probs
        torch.cuda.empty_cache()
    kb.log(f"{batch}x{ctx} {'timed' if rows is not None else 'compiled'} in {time.time() - t0:.0f} s"
           + (f" (sdpa {t_sdpa:.4f} ms)" if rows is not None else ""))


def _warm(task) -> None:
    torch.set_grad_enabled(False)
    batch, ctx, dtypes, names = task
    run_case(batch, ctx, dtypes, reps=1, rows=None, names=names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtypes", default="fp8_e4m3,fp8_e5m2,int8,fp16,bf16")
    ap.add_argument("--cases", default=None, help="indices into kernels.DECODE_CASES")
    ap.add_argument("--jobs", type=int, default=0, help="compile in this many processes first")
    ap.add_argument("--variants", default=None, help="comma list of variant names (default all)")
    ap.add_argument("--compile-only", action="store_true", help="stop after the compile phase")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    t0 = time.time()
    cases = kb.DECODE_CASES if args.cases is None else [kb.DECODE_CASES[int(i)] for i in args.cases.split(",")]
    dtypes = args.dtypes.split(",")
    names = args.variants.split(",") if args.variants else None
    if args.jobs:
        tasks = [(b, c, [kv], names) for b, c in cases for kv in dtypes]
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            pool.map(_warm, tasks, chunksize=1)
        kb.log(f"compiled in {time.time() - t0:.0f} s")
    if args.compile_only:
        return
    rows: list = []
    for batch, ctx in cases:
        run_case(batch, ctx, dtypes, args.reps, rows, names)
    print("\n| case | kv | kernel | ms | vs SDPA | ideal | rel. L2 vs plain |\n|---|---|---|---|---|---|---|")
    for case, kv, name, t, sp, ideal, err in rows:
        print(f"| {case} | {kv} | {name} | {t:.4f} | {sp:.3f}x | {ideal:.2f}x | {err:.1e} |")
    print(f"total {time.time() - t0:.0f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
