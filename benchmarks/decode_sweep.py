"""Decode-kernel tuning sweep (H200): tile x warps x pipeline depth x split policy, per KV dtype.

    python benchmarks/decode_sweep.py [--dtypes fp16,fp8_e4m3] [--cases 0,1] [--jobs 14] [--out DIR]

Phase 1 compiles every variant in parallel worker processes (Triton's on-disk cache then serves the
timing process). Phase 2 times each variant with every split policy on the grid cases (same timing
as benchmarks/kernels.py: CUDA-graph replays, median), then the best variant per dtype on every
decode case of kernels.py, against SDPA over contiguous fp16 K/V. Prints one line per measurement
and a summary table last.
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as kb  # noqa: E402  (maps kvmesh to shared/ when not installed)

from kvmesh.kernels.decode_attention import decode_attention  # noqa: E402
from kvmesh.kernels.decode_tiles import TILES  # noqa: E402
from kvmesh.kernels.formats import FMT_CODES  # noqa: E402

GRID = dict(block_n=(32, 64, 128), num_warps=(4,), num_stages=(1, 3, 5))
PROGRAMS_PER_SM = (0, 2, 4, 8)  # residency assumed by the split count; 0 = read from the compiled kernel
CODE_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")  # also timed with hardware conversion / split words


def variants(kv: str, grid: dict = GRID, tiles_only: bool = False) -> list[dict]:
    if tiles_only:  # the shipped tiles of this dtype, times the grid's other axes (e.g. block_h)
        t = TILES[FMT_CODES[kv]]
        extra = {k: v for k, v in grid.items() if k not in ("block_n", "num_stages", "num_warps")}
        return [dict(block_n=t.block_n, num_stages=t.num_stages, native_cvt=t.native_cvt, **dict(zip(extra, v)))
                for v in itertools.product(*extra.values())]
    out = [dict(zip(grid, v)) for v in itertools.product(*grid.values())]
    if kv in CODE_DTYPES:
        out += [{**c, "native_cvt": True} for c in out] + [{**c, "split_codes": 1} for c in out] + [
            {**c, "split_codes": 2, "native_cvt": True} for c in out]
    return out


def _problem(kv: str, batch: int, ctx: int):
    """(cache, meta, q, k_new, v_new, the case's data) for one decode case."""
    case = kb.decode_case(batch, ctx)
    return (*kb.decode_problem(kv, case), case)


def _compile_worker(jobs: list[tuple[str, dict]]) -> int:
    """Runs each (dtype, variant) once with one and with several splits: fills Triton's cache."""
    torch.set_grad_enabled(False)
    failed = 0
    problems: dict = {}
    for kv, cfg in jobs:
        if kv not in problems:
            problems[kv] = _problem(kv, 2, 512)
        cache, meta, q, kn, vn, *_ = problems[kv]
        for splits in (1, 2):
            try:
                decode_attention(cache, 0, q, kn, vn, meta, kb.D ** -0.5, splits=splits, direct=False, **cfg)
            except Exception:
                failed += 1
    torch.cuda.synchronize()
    return failed


def compile_all(dtypes: list[str], jobs: int, grid: dict, tiles_only: bool) -> None:
    work = [(kv, c) for kv in dtypes for c in variants(kv, grid, tiles_only)]
    chunks = [work[i::jobs] for i in range(jobs)]
    t0 = time.time()
    with mp.get_context("spawn").Pool(jobs) as pool:
        failed = sum(pool.map(_compile_worker, chunks))
    kb.log(f"compiled {len(work)} variants x 2 in {time.time() - t0:.0f} s ({failed} failed launches)")


def time_case(kv: str, batch: int, ctx: int, cfgs: list[dict], pps: tuple, reps: int, results: list) -> None:
    cache, meta, q, kn, vn, case = _problem(kv, batch, ctx)
    t_sdpa, _ = kb.time_sdpa(case, reps)
    del case
    ref = decode_attention(cache, 0, q, kn, vn, meta, kb.D ** -0.5, splits=1, block_n=32, num_stages=3, direct=False)
    kb.log(f"{kv} {batch}x{ctx}: sdpa {t_sdpa:.4f} ms")
    for cfg, p in itertools.product(cfgs, pps):
        full = {**cfg, "programs_per_sm": p}
        try:
            fn = lambda: decode_attention(cache, 0, q, kn, vn, meta, kb.D ** -0.5, direct=False, **full)  # noqa: E731
            err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
            t = kb.time_ms(fn, reps)
            results.append(dict(kv=kv, case=f"{batch}x{ctx}", cfg=full, ms=t, sdpa=t_sdpa, err=err))
            kb.log(f"  {json.dumps(full)}: {t:.4f} ms  {t_sdpa / t:.2f}x  (err {err:.1e})")
        except Exception as e:
            kb.log(f"  {json.dumps(full)}: FAILED {type(e).__name__}: {str(e)[:160]}")
    del cache
    torch.cuda.empty_cache()


def best_per_dtype(results: list, dtypes: list[str]) -> dict:
    """The variant with the best geometric-mean speedup over the grid cases, per dtype."""
    best = {}
    for kv in dtypes:
        by_cfg: dict = {}
        for r in results:
            if r["kv"] == kv and r["err"] < 1e-2:
                by_cfg.setdefault(json.dumps(r["cfg"], sort_keys=True), []).append(r["sdpa"] / r["ms"])
        n_cases = max((len(v) for v in by_cfg.values()), default=0)
        scored = [(statistics.geometric_mean(v), k) for k, v in by_cfg.items() if len(v) == n_cases]
        if scored:
            best[kv] = json.loads(max(scored)[1])
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="fp16,bf16,fp8_e4m3,fp8_e5m2,int8,int4")
    ap.add_argument("--cases", default="0,1", help="grid cases (indices into kernels.DECODE_CASES)")
    ap.add_argument("--jobs", type=int, default=14, help="parallel compile processes")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--block-n", default=None, help="tile sizes to try, e.g. 64,128 (default: GRID's)")
    ap.add_argument("--stages", default=None, help="pipeline depths to try, e.g. 3,5 (default: GRID's)")
    ap.add_argument("--programs-per-sm", default=None, help="split policies, e.g. 0,8 (default: all)")
    ap.add_argument("--tiles-only", action="store_true", help="only the shipped tiles (decode_tiles.TILES)")
    ap.add_argument("--block-h", default=None, help="query rows per program to try, e.g. 4,16 (default: 16)")
    ap.add_argument("--heads-first", default=None, help="grid orders to try, e.g. 0,1 (default: the tile's)")
    ap.add_argument("--out", type=Path, default=Path("decode_sweep_out"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    dtypes = args.dtypes.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    grid = dict(GRID)
    if args.block_n:
        grid["block_n"] = tuple(int(x) for x in args.block_n.split(","))
    if args.stages:
        grid["num_stages"] = tuple(int(x) for x in args.stages.split(","))
    pps = tuple(int(x) for x in args.programs_per_sm.split(",")) if args.programs_per_sm else PROGRAMS_PER_SM
    if args.block_h:
        grid["block_h"] = tuple(int(x) for x in args.block_h.split(","))
    if args.heads_first:
        grid["heads_first"] = tuple(bool(int(x)) for x in args.heads_first.split(","))
    t0 = time.time()
    compile_all(dtypes, args.jobs, grid, args.tiles_only)
    results: list = []
    for kv in dtypes:
        for i in args.cases.split(","):
            batch, ctx = kb.DECODE_CASES[int(i)]
            try:
                time_case(kv, batch, ctx, variants(kv, grid, args.tiles_only), pps, args.reps, results)
            except Exception:
                kb.log(f"{kv} {batch}x{ctx} FAILED:\n{traceback.format_exc()}")
        (args.out / "sweep.json").write_text(json.dumps(results, indent=1))
        kb.log(f"({time.time() - t0:.0f} s)")
    best = best_per_dtype(results, dtypes)
    final: list = []
    for kv, cfg in best.items():
        pps = (cfg.pop("programs_per_sm"),)
        for batch, ctx in kb.DECODE_CASES:
            try:
                time_case(kv, batch, ctx, [cfg], pps, args.reps, final)
            except Exception:
                kb.log(f"{kv} {batch}x{ctx} FAILED:\n{traceback.format_exc()}")
    (args.out / "best.json").write_text(json.dumps(final, indent=1))
    lines = ["| dtype | variant | " + " | ".join(f"{b}x{c}" for b, c in kb.DECODE_CASES) + " |",
             "|---|---|" + "---|" * len(kb.DECODE_CASES)]
    for kv in best:
        rs = {r["case"]: r for r in final if r["kv"] == kv}
        cells = [f"{rs[f'{b}x{c}']['ms']:.3f} ms {rs[f'{b}x{c}']['sdpa'] / rs[f'{b}x{c}']['ms']:.2f}x"
                 if f"{b}x{c}" in rs else "-" for b, c in kb.DECODE_CASES]
        cfg = next((r["cfg"] for r in final if r["kv"] == kv), {})
        lines.append(f"| {kv} | {json.dumps(cfg)} | " + " | ".join(cells) + " |")
    md = "\n".join(lines)
    (args.out / "summary.md").write_text(md + "\n")
    kb.log("\n" + md + f"\n\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
