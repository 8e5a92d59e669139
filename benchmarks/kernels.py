"""Kernel benchmark (H200): paged decode per KV dtype vs torch SDPA, cache write, prefill/extend.

    python benchmarks/kernels.py [--quick] [--out results.md]

Everything is measured in one run: 10 calls captured in a CUDA graph, replays timed with CUDA events
(median of --reps), so host launch costs stay out for SDPA and our kernels alike. Decode: 32 query heads,
8 KV heads, head_dim 128, block 16, pages in random order, one layer. Columns: time, effective TB/s
(bytes of KV pages incl. scales + q + out, divided by time), % of the read bandwidth measured here
(torch.sum over 4 GiB), speedup vs SDPA(enable_gqa=True) over contiguous fp16 K/V of the same shape,
and the ideal speedup 16 / (stored bits per element incl. scales).
Each case runs in its own try/except and prints as it goes, so a failure costs one row, not the run.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F



def _make_importable() -> None:
    """Without the editable install (the H200), map `kvmesh` to the checkout's shared/ folder."""
    try:
        import kvmesh  # noqa: F401
    except ImportError:
        shim = Path(tempfile.mkdtemp(prefix="kvmesh_shim_"))  # one a process: checkouts side by side
        (shim / "kvmesh").symlink_to(Path(__file__).resolve().parents[1] / "shared")
        sys.path.insert(0, str(shim))


_make_importable()

from kvmesh.kernels.cache_write import write_blocks  # noqa: E402
from kvmesh.kernels.decode_attention import decode_attention  # noqa: E402
from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata  # noqa: E402
from kvmesh.kernels.prefill_attention import prefill_attention  # noqa: E402
from kvmesh.kernels.prefix_stage import stage_prefix  # noqa: E402
from kvmesh.kernels.triton_backend import TritonBackend  # noqa: E402
from kvmesh.kv.layout import BlockLayout  # noqa: E402
from kvmesh.kv.pool import KVCache  # noqa: E402

H, KVH, D, BS = 32, 8, 128, 16
DECODE_CASES = [(64, 4096), (16, 16384), (256, 1024), (8, 32768)]
KV_DTYPES = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
DIRECT_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")  # served by the register-direct kernels (fp16 models)


def log(*a) -> None:
    print(*a, flush=True)


def time_ms(fn, reps: int, warmup: int = 3, calls: int = 10, graph: bool = True) -> float:
    """Median milliseconds per call of `fn`: `calls` back-to-back calls captured in one CUDA graph,
    replayed `reps` times between CUDA events. The graph takes the host's launch cost (Python
    launchers run 20-50 us) out of the number, for SDPA and our kernels alike; a function that cannot
    be captured is timed call by call instead."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    try:
        if not graph:
            raise RuntimeError("graph capture not wanted")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run, per = graph.replay, calls
    except Exception as e:  # not capturable: time each call (includes launch cost)
        if graph:
            log(f"    (no CUDA graph: {type(e).__name__}: {str(e)[:120]})")
        torch.cuda.synchronize()
        run, per = fn, 1
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / per)
    return statistics.median(times)


def read_bandwidth(reps: int) -> tuple[float, float]:
    """(streaming read TB/s by torch.sum over 4 GiB, copy TB/s counting read + write)."""
    x = torch.empty(1 << 31, dtype=torch.float16, device="cuda").uniform_()
    # milliseconds-long single calls, no graph: a captured copy becomes a copy-engine memcpy node
    t = time_ms(lambda: x.sum(), reps, graph=False)
    read = x.numel() * 2 / t / 1e9
    y = torch.empty_like(x[: 1 << 30])
    t2 = time_ms(lambda: y.copy_(x[: 1 << 30]), reps, graph=False)
    copy = 2 * y.numel() * 2 / t2 / 1e9
    del x, y
    return read, copy


def model_dtype_for(kv: str) -> torch.dtype:
    return torch.bfloat16 if kv == "bf16" else torch.float16


def filled_cache(kv: str, k_rows: torch.Tensor, v_rows: torch.Tensor, n_pages: int,
                 perm: torch.Tensor, model_dtype: torch.dtype | None = None, pool_pages: int = 0) -> KVCache:
    """A one-layer cache whose page perm[i] holds rows i*BS..(i+1)*BS of k_rows/v_rows [N, KVH, D]; a
    pool of max(n_pages, pool_pages) pages (perm's entries below it)."""
    layout = BlockLayout(num_layers=1, kv_heads=KVH, head_dim=D, block_size=BS, kv_dtype=kv)
    dt = model_dtype or model_dtype_for(kv)
    cache = KVCache(layout, max(n_pages, pool_pages), 1, dt, "cuda")
    rows = torch.arange(n_pages * BS, device="cuda").view(n_pages, BS) + BS  # S = 1 slot, then new rows
    for i in range(0, n_pages, 8192):
        j = min(n_pages, i + 8192)
        write_blocks(cache, 0, k_rows[i * BS:j * BS].to(dt), v_rows[i * BS:j * BS].to(dt),
                     rows[: j - i], perm[i:j])
    return cache


def decode_meta(batch: int, ctx: int, perm: torch.Tensor, layout: BlockLayout):
    pages = ctx // BS
    seqs = [SeqSlice(ctx, 1, perm[b * pages:(b + 1) * pages].tolist() + [-1], 0) for b in range(batch)]
    return build_attention_metadata(seqs, layout, 1, "cuda")


@dataclass(frozen=True)
class DecodeCase:
    """One decode case's data, drawn from a generator seeded by the case: fp16 K/V rows [N, KVH, D]
    (the rows of page perm[i] are i*BS..(i+1)*BS), q [B, H, 1, D], and the generator for more."""

    batch: int
    ctx: int
    k_rows: torch.Tensor
    v_rows: torch.Tensor
    perm: torch.Tensor
    qs: torch.Tensor
    gen: torch.Generator

    @property
    def n_pages(self) -> int:
        return self.batch * self.ctx // BS


def decode_case(batch: int, ctx: int) -> DecodeCase:
    n_pages = batch * ctx // BS
    g = torch.Generator(device="cuda").manual_seed(batch * ctx)
    k_rows = torch.randn(n_pages * BS, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    v_rows = torch.randn(n_pages * BS, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    perm = torch.randperm(n_pages, device="cuda", generator=g)
    qs = torch.randn(batch, H, 1, D, device="cuda", dtype=torch.float16, generator=g)
    return DecodeCase(batch, ctx, k_rows, v_rows, perm, qs, g)


def decode_problem(kv: str, case: DecodeCase, model_dtype: torch.dtype | None = None, pool_pages: int = 0):
    """(cache, meta, q [B, H, D], new k, new v [B, KVH, D]) of one decode case over `kv` pages, in a
    model of `model_dtype` (default: the one kv's rows come from); new K/V from the case's generator.
    pool_pages > the case's pages: its pages scattered over a pool that large (a serving engine's)."""
    dt = model_dtype or model_dtype_for(kv)
    perm = case.perm
    if pool_pages > case.n_pages:  # distinct random pages of the larger pool, in the case's order
        perm = torch.randperm(pool_pages, device="cuda", generator=case.gen)[:case.n_pages][perm]
    cache = filled_cache(kv, case.k_rows, case.v_rows, case.n_pages, perm, dt, pool_pages)
    meta = decode_meta(case.batch, case.ctx, perm, cache.layout)
    q = case.qs[:, :, 0].to(dt).contiguous()
    kn = torch.randn(case.batch, KVH, D, device="cuda", dtype=dt, generator=case.gen)
    vn = torch.randn(case.batch, KVH, D, device="cuda", dtype=dt, generator=case.gen)
    return cache, meta, q, kn, vn


def decode_problems(kv_dtypes, reps: int):
    """For each decode case and KV dtype: ("BxC", SDPA's ms on the case, kv, decode_problem's tuple)."""
    for batch, ctx in DECODE_CASES:
        case = decode_case(batch, ctx)
        t_sdpa, _ = time_sdpa(case, reps)
        for kv in kv_dtypes:
            yield f"{batch}x{ctx}", t_sdpa, kv, decode_problem(kv, case)
            torch.cuda.empty_cache()


def time_sdpa(case: DecodeCase, reps: int) -> tuple[float, int]:
    """(ms, bytes moved) of SDPA (enable_gqa) over contiguous fp16 K/V [B, KVH, ctx, D] of the case's
    data; the contiguous copies are freed before returning."""
    kc = case.k_rows.view(case.batch, case.ctx, KVH, D).transpose(1, 2).contiguous()
    vc = case.v_rows.view(case.batch, case.ctx, KVH, D).transpose(1, 2).contiguous()
    t = time_ms(lambda: F.scaled_dot_product_attention(case.qs, kc, vc, enable_gqa=True), reps)
    return t, 2 * kc.numel() * 2 + 2 * case.qs.numel() * 2


def bench_decode(batch: int, ctx: int, reps: int, read_tbs: float, rows: list) -> None:
    case = decode_case(batch, ctx)
    t_sdpa, sdpa_bytes = time_sdpa(case, reps)
    rows.append((f"{batch}x{ctx}", "sdpa fp16 contiguous", t_sdpa, sdpa_bytes / t_sdpa / 1e9,
                 sdpa_bytes / t_sdpa / 1e9 / read_tbs, 1.0, 1.0))
    log(f"  sdpa {batch}x{ctx}: {t_sdpa * 1e3:.1f} us")
    for kv in KV_DTYPES:
        try:
            cache, meta, q, kn, vn = decode_problem(kv, case)  # q [B, H, D]
            scale = D ** -0.5
            nbytes = case.n_pages * cache.layout.block_bytes + 2 * q.numel() * q.element_size()
            ideal = 16 / (8 * cache.layout.bytes_per_token / (2 * KVH * D))  # 16 / stored bits per element
            # the engine's path (the register-direct kernel for 8-bit pages), and the plain Triton
            # kernel beside it where they differ
            paths = [("", None)] + ([(" plain", False)] if kv in DIRECT_DTYPES else [])
            for label, direct in paths:
                t = time_ms(lambda: decode_attention(cache, 0, q, kn, vn, meta, scale, direct=direct), reps)
                name = f"paged {kv}{' direct' if kv in DIRECT_DTYPES and direct is None else label}"
                rows.append((f"{batch}x{ctx}", name, t, nbytes / t / 1e9, nbytes / t / 1e9 / read_tbs,
                             t_sdpa / t, ideal))
                log(f"  {name:24s} {batch}x{ctx}: {t * 1e3:.1f} us  {t_sdpa / t:.3f}x sdpa  (ideal {ideal:.2f}x)")
            del cache
        except Exception:  # one failed dtype costs one row
            log(f"  {kv} {batch}x{ctx} FAILED:\n{traceback.format_exc()}")
            rows.append((f"{batch}x{ctx}", f"paged {kv}", math.nan, math.nan, math.nan, math.nan, math.nan))
        torch.cuda.empty_cache()


def bench_write(reps: int, copy_tbs: float, rows: list) -> None:
    n_blocks = 16384
    g = torch.Generator(device="cuda").manual_seed(7)
    for kv in KV_DTYPES:
        try:
            dt = model_dtype_for(kv)
            k = torch.randn(n_blocks * BS, KVH, D, device="cuda", dtype=dt, generator=g)
            v = torch.randn(n_blocks * BS, KVH, D, device="cuda", dtype=dt, generator=g)
            layout = BlockLayout(num_layers=1, kv_heads=KVH, head_dim=D, block_size=BS, kv_dtype=kv)
            cache = KVCache(layout, n_blocks, 1, dt, "cuda")
            rows_ = torch.arange(n_blocks * BS, device="cuda").view(n_blocks, BS) + BS
            ids = torch.randperm(n_blocks, device="cuda", generator=g)
            t = time_ms(lambda: write_blocks(cache, 0, k, v, rows_, ids), reps)
            nbytes = 2 * k.numel() * k.element_size() + n_blocks * layout.block_bytes + rows_.numel() * 8
            tbs = nbytes / t / 1e9
            rows.append(("write 16384 blocks", f"cache write {kv}", t, tbs, tbs / copy_tbs, math.nan, math.nan))
            log(f"  write {kv}: {t:.3f} ms, {tbs:.2f} TB/s = {100 * tbs / copy_tbs:.0f}% of copy")
            del cache, k, v
        except Exception:
            log(f"  write {kv} FAILED:\n{traceback.format_exc()}")
        torch.cuda.empty_cache()


def bench_prefill(reps: int, rows: list, dtypes: list[str]) -> None:
    B, new, prefix = 4, 2048, 2048
    g = torch.Generator(device="cuda").manual_seed(11)
    T = B * new
    q = torch.randn(T, H, D, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(T, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(T, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    kp = torch.randn(B * prefix, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    vp = torch.randn(B * prefix, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    # SDPA: causal, bottom-right aligned (new tokens see the whole prefix), contiguous
    qs = q.view(B, new, H, D).transpose(1, 2)
    ks = torch.cat([kp.view(B, prefix, KVH, D), k.view(B, new, KVH, D)], 1).transpose(1, 2).contiguous()
    vs = torch.cat([vp.view(B, prefix, KVH, D), v.view(B, new, KVH, D)], 1).transpose(1, 2).contiguous()
    t_sdpa = math.nan
    try:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(new, new + prefix)
        t_sdpa = time_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True), reps)
    except Exception:
        log(f"  sdpa lower-right causal FAILED, trying repeated heads:\n{traceback.format_exc()}")
        try:
            from torch.nn.attention.bias import causal_lower_right
            mask = causal_lower_right(new, new + prefix)
            kr, vr = ks.repeat_interleave(H // KVH, 1), vs.repeat_interleave(H // KVH, 1)
            t_sdpa = time_ms(lambda: F.scaled_dot_product_attention(qs, kr, vr, attn_mask=mask), reps)
        except Exception:
            log(f"  sdpa FAILED:\n{traceback.format_exc()}")
    flops = 4 * B * H * D * (new * prefix + new * (new + 1) / 2)
    rows.append(("prefill 4x2048 +2048", "sdpa causal fp16", t_sdpa, flops / t_sdpa / 1e9, math.nan, 1.0, math.nan))
    log(f"  sdpa prefill: {t_sdpa:.3f} ms ({flops / t_sdpa / 1e9:.0f} TFLOP/s)")
    n_pages = B * prefix // BS
    perm = torch.randperm(n_pages, device="cuda", generator=g)
    pp, pn = prefix // BS, new // BS
    for kv in dtypes:
        try:
            cache = filled_cache(kv, kp, vp, n_pages, perm)  # the new tokens' blocks are never read
            seqs = [SeqSlice(prefix, new, perm[b * pp:(b + 1) * pp].tolist() + [0] * pn, 0) for b in range(B)]
            meta = build_attention_metadata(seqs, cache.layout, 1, "cuda")
            dt = model_dtype_for(kv)
            qd, kd, vd = q.to(dt), k.to(dt), v.to(dt)
            # staged (the default for these 2,048-token chunks, `prefix_stage.py`) and read in place
            for staging in ((True, False) if meta.stage is not None else (False,)):
                t = time_ms(lambda: prefill_attention(cache, 0, qd, kd, vd, meta, D ** -0.5, staging=staging), reps)
                name = f"paged {kv}" + (" (pages in place)" if meta.stage is not None and not staging else "")
                rows.append(("prefill 4x2048 +2048", name, t, flops / t / 1e9, math.nan, t_sdpa / t, math.nan))
                log(f"  prefill {name}: {t:.3f} ms ({flops / t / 1e9:.0f} TFLOP/s, {t_sdpa / t:.2f}x sdpa)")
            if meta.stage is not None:
                t = time_ms(lambda: stage_prefix(cache, 0, meta.stage), reps)
                log(f"  of which staging the {meta.stage.src_pages.numel()} prefix pages: {t:.3f} ms")
                bench_mixed_step(cache, perm, q, k, v, dt, reps, rows)
            del cache
        except Exception:
            log(f"  prefill {kv} FAILED:\n{traceback.format_exc()}")
        torch.cuda.empty_cache()


def bench_mixed_step(cache: KVCache, perm: torch.Tensor, q, k, v, dt: torch.dtype, reps: int,
                     rows: list) -> None:
    """A chunked-prefill step: 2 chunks of 2,048 tokens and 62 decode rows, each over a 2,048-token
    prefix. Three ways: every page read in place by the prefill kernel; the chunks' prefixes staged
    (two launches); the backend's split (decode rows to the decode kernel, chunks staged)."""
    pp, n_dec, new, kv = 2048 // BS, 62, 2048, cache.layout.kv_dtype
    seqs = [SeqSlice(2048, new, perm[b * pp:(b + 1) * pp].tolist() + [0] * (new // BS), 0) for b in range(2)]
    seqs += [SeqSlice(2048, 1, perm[(2 + i % 2) * pp:(3 + i % 2) * pp].tolist() + [0], 0) for i in range(n_dec)]
    meta = build_attention_metadata(seqs, cache.layout, 1, "cuda")
    split = build_attention_metadata(seqs, cache.layout, 1, "cuda", split_mixed=True)
    T = 2 * new + n_dec
    qd, kd, vd = q[:T].to(dt), k[:T].to(dt), v[:T].to(dt)
    ways = {"prefill kernel, pages in place": lambda: prefill_attention(cache, 0, qd, kd, vd, meta, D ** -0.5, staging=False),
            "prefill kernel, chunks staged": lambda: prefill_attention(cache, 0, qd, kd, vd, meta, D ** -0.5),
            "decode rows split off + staged": lambda: TritonBackend().attend(cache, 0, qd, kd, vd, split, D ** -0.5)}
    base = None
    for name, fn in ways.items():
        t = time_ms(fn, reps)
        base = base or t
        rows.append(("mixed 2x2048 + 62 decode, +2048", f"{kv}: {name} ({base / t:.2f}x the first way)", t,
                     math.nan, math.nan, math.nan, math.nan))
        log(f"  mixed step {kv}, {name}: {t:.3f} ms ({base / t:.2f}x the first)")


def table(rows: list, read_tbs: float, copy_tbs: float) -> str:
    lines = [f"read bandwidth (torch.sum, 4 GiB): {read_tbs:.2f} TB/s; copy (read + write): {copy_tbs:.2f} TB/s",
             "", "| case | kernel | time µs | TB/s (TFLOP/s for prefill) | % of bandwidth | speedup vs SDPA | ideal |",
             "|---|---|---|---|---|---|---|"]
    for case, name, t, tbs, frac, sp, ideal in rows:
        pct = "" if math.isnan(frac) else f"{100 * frac:.0f}%"
        spd = "" if math.isnan(sp) else f"{sp:.3f}x"
        idl = "" if math.isnan(ideal) else f"{ideal:.2f}x"
        lines.append(f"| {case} | {name} | {t * 1e3:.1f} | {tbs:.2f} | {pct} | {spd} | {idl} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one decode case, fewer repetitions")
    ap.add_argument("--cases", type=str, default=None, help="decode case indices, e.g. 0,3 (default all)")
    ap.add_argument("--skip", type=str, default="", help="comma list of parts to skip: decode,write,prefill")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    torch.set_grad_enabled(False)
    reps = args.reps or (10 if args.quick else 30)
    t0 = time.time()
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    read_tbs, copy_tbs = read_bandwidth(reps)
    log(f"read {read_tbs:.2f} TB/s, copy {copy_tbs:.2f} TB/s")
    rows: list = []
    skip = set(args.skip.split(","))
    cases = DECODE_CASES[:1] if args.quick else DECODE_CASES
    if args.cases:
        cases = [DECODE_CASES[int(i)] for i in args.cases.split(",")]
    for i, (batch, ctx) in enumerate([] if "decode" in skip else cases):
        log(f"decode {batch}x{ctx} ({time.time() - t0:.0f} s)")
        try:
            bench_decode(batch, ctx, reps, read_tbs, rows)
        except Exception:
            log(f"decode {batch}x{ctx} FAILED:\n{traceback.format_exc()}")
        torch.cuda.empty_cache()
    if "write" not in skip:
        log(f"cache write ({time.time() - t0:.0f} s)")
        bench_write(reps, copy_tbs, rows)
    if "prefill" not in skip:
        log(f"prefill ({time.time() - t0:.0f} s)")
        bench_prefill(reps, rows, ["fp16", "fp8_e4m3", "int8", "int4"] if args.quick else KV_DTYPES)
    md = table(rows, read_tbs, copy_tbs)
    log("\n" + md)
    log(f"\ntotal {time.time() - t0:.0f} s")
    if args.out:
        args.out.write_text(md + "\n")


if __name__ == "__main__":
    main()
