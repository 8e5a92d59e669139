"""What DRAM gives a paged read on this GPU: runs of R contiguous bytes at random places (as a decode
kernel reads a page's K or V run per KV head), against the same runs in order, in one table:

    python3 benchmarks/page_reads.py [--reps 15] [--quick] [--int4-pages]

A plain Triton kernel sums 512 MB of runs; each program reads 64 KB of them, one run (or 2 KB of it)
per load, the loop pipelined `stages` deep. Rows vary the run length (1 KB = an INT4 page's K run per
head at D 128, block 16; 2 KB fp8/int8; 4 KB fp16), the runs' alignment (pad: bytes between runs, so
64 leaves them 64-byte aligned as fp8 pages are: 32,768 bytes of codes + 64 of scales), and the
program shape (warps x stages). The ratio column divides by the in-order 64 KB runs of the same
shape, which stream like `torch.sum`. With --int4-pages, instead: what an INT4 decode chunk reads of
a page for one KV head (Llama-3-8B heads, block 16: K rows 1 KB, V rows 1 KB 8 KB further, the K
record's 272 bytes and the V codes' 128), (page, head) pairs in random order, against the K and V
rows alone and against the same four runs side by side a head (a layout the format could take),
the small runs read through loads as wide as the rows (masked) or as wide as each run. Results:
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

import kernels as kb  # benchmarks/kernels.py: timing (CUDA graphs, events, median), kvmesh on the path
from kvmesh.kernels.int4_codec import HEADER  # noqa: E402  (bytes of a K record's headers)
from kvmesh.kv.layout import BlockLayout  # noqa: E402

TOTAL = 1 << 29  # bytes of runs read per launch


@triton.jit
def runs_kernel(src, ids, out, stride, RUN: tl.constexpr, PIECE: tl.constexpr, PER: tl.constexpr,
                STAGES: tl.constexpr):
    """Program p sums runs ids[p * PER:(p + 1) * PER] of src (int32, runs `stride` words apart)."""
    pid = tl.program_id(0)
    acc = tl.zeros([PIECE // 4], tl.int32)
    for j in tl.range(0, PER, num_stages=STAGES):
        base = src + tl.load(ids + pid * PER + j).to(tl.int64) * stride
        for p in tl.static_range(RUN // PIECE):
            acc += tl.load(base + p * (PIECE // 4) + tl.arange(0, PIECE // 4))
    tl.store(out + pid, tl.sum(acc))


@triton.jit
def int4_chunk_kernel(src, ids, out, PAGE: tl.constexpr, K0: tl.constexpr, KH: tl.constexpr, V0: tl.constexpr,
                      VH: tl.constexpr, R0: tl.constexpr, RH: tl.constexpr, REC_BYTES: tl.constexpr, C0: tl.constexpr,
                      CH: tl.constexpr, VC_BYTES: tl.constexpr, ROWS: tl.constexpr, SMALL: tl.constexpr,
                      PER: tl.constexpr, STAGES: tl.constexpr, EXACT: tl.constexpr = False,
                      REC_W1: tl.constexpr = 1, REC_W2: tl.constexpr = 1):
    """Program p sums, for the (page, head) pairs ids[p * PER:(p + 1) * PER], what an INT4 chunk reads
    of a one-layer page (int32 words; offsets in bytes, each region at X0 + head * XH): the head's K
    rows and V rows (ROWS bytes each), with SMALL its K record (REC_BYTES) and its V codes (VC_BYTES):
    through loads as wide as the rows, masked, or with EXACT as wide as each run (the record as
    REC_W1 + REC_W2 words, powers of two)."""
    pid = tl.program_id(0)
    w = tl.arange(0, ROWS // 4)
    acc = tl.zeros([ROWS // 4], tl.int32)
    r1 = tl.arange(0, REC_W1)
    r2 = tl.arange(0, REC_W2)
    cw = tl.arange(0, VC_BYTES // 4)
    acc_r1 = tl.zeros([REC_W1], tl.int32)
    acc_r2 = tl.zeros([REC_W2], tl.int32)
    acc_c = tl.zeros([VC_BYTES // 4], tl.int32)
    for j in tl.range(0, PER, num_stages=STAGES):
        pair = tl.load(ids + pid * PER + j)
        base = src + (pair // 8).to(tl.int64) * (PAGE // 4)
        head = pair % 8
        acc += tl.load(base + (K0 + head * KH) // 4 + w) + tl.load(base + (V0 + head * VH) // 4 + w)
        if SMALL:
            if EXACT:
                rec = base + (R0 + head * RH) // 4
                acc_r1 += tl.load(rec + r1)
                acc_r2 += tl.load(rec + REC_W1 + r2)
                acc_c += tl.load(base + (C0 + head * CH) // 4 + cw)
            else:
                acc += tl.load(base + (R0 + head * RH) // 4 + w, mask=w < REC_BYTES // 4, other=0)
                acc += tl.load(base + (C0 + head * CH) // 4 + w, mask=w < VC_BYTES // 4, other=0)
    tl.store(out + pid, tl.sum(acc) + tl.sum(acc_r1) + tl.sum(acc_r2) + tl.sum(acc_c))


def int4_chunk_args(small: bool, by_head: bool, exact: bool) -> dict:
    """int4_chunk_kernel's constexprs for Llama-3-8B heads (D 128, block 16, one layer): where each of
    a head's four runs sits (the regions as stored, or by_head: [K rows | K record | V rows | V codes]
    a head) and how the small runs load."""
    L = BlockLayout(num_layers=1, kv_heads=8, head_dim=128, block_size=16, kv_dtype="int4")
    rows = L.block_size * L.head_dim // 2  # a head's K (or V) rows: one chunk at block 16
    rec, vc = HEADER.value + 2 * L.head_dim, L.block_size * L.head_dim // 16  # a head's K record, its V codes
    if by_head:
        hs = 2 * rows + rec + vc
        at = dict(K0=0, KH=hs, R0=rows, RH=hs, V0=rows + rec, VH=hs, C0=2 * rows + rec, CH=hs)
    else:
        at = dict(K0=0, KH=rows, V0=L.v_data_offset, VH=rows, R0=L.k_scale_offset, RH=rec, C0=L.v_scale_offset, CH=vc)
    w1 = 1 << ((rec // 4).bit_length() - 1)  # the record's words as two powers of two (68 = 64 + 4)
    return dict(PAGE=L.layer_bytes, REC_BYTES=rec, VC_BYTES=vc, ROWS=rows, SMALL=small, EXACT=exact, REC_W1=w1,
                REC_W2=rec // 4 - w1, **at)


def time_int4_pages(buf: torch.Tensor, small: bool, grouped: bool, warps: int, stages: int, reps: int,
                    by_head: bool = False, exact: bool = False) -> float:
    """TB/s of useful bytes: every (page, head) pair of the buffer's pages once, pages in random order
    (grouped: a page's 8 heads one after another, as the programs of a sequence meet them). by_head:
    the same bytes, but each head's four runs side by side, [K rows | K record | V rows | V codes]
    (a layout the format could take), instead of the regions of all heads one after another; exact:
    each small run through a load of its own width."""
    args = int4_chunk_args(small, by_head, exact)
    n_pages = TOTAL // args["PAGE"]
    per = 32
    n = n_pages * 8 // per * per
    g = torch.Generator(device="cuda").manual_seed(7)
    if grouped:
        ids = (torch.randperm(n_pages, device="cuda", generator=g)[:, None] * 8
               + torch.arange(8, device="cuda")[None, :]).reshape(-1)[:n]
    else:
        ids = torch.randperm(n_pages * 8, device="cuda", generator=g)[:n]
    ids = ids.to(torch.int32).contiguous()
    out = torch.empty(n // per, dtype=torch.int32, device="cuda")

    def call():
        int4_chunk_kernel[(n // per,)](buf, ids, out, PER=per, STAGES=stages, num_warps=warps, **args)
    t = kb.time_ms(call, reps)
    return n * (2 * args["ROWS"] + (args["REC_BYTES"] + args["VC_BYTES"] if small else 0)) / t / 1e9


def int4_pages(buf: torch.Tensor, reps: int) -> None:
    rows = []
    for warps, stages in ((4, 3), (1, 3), (4, 1)):
        ref = time_runs(buf, 65536, 0, "seq", warps, stages, reps)
        for grouped in (False, True):
            for small, by_head, exact in ((False, False, False), (True, False, False), (True, True, False),
                                          (True, False, True), (True, True, True)):
                tbs = time_int4_pages(buf, small, grouped, warps, stages, reps, by_head, exact)
                rows.append((warps, stages, grouped, small, by_head, exact, tbs, tbs / ref))
                kb.log(f"  {warps} x {stages}  grouped {grouped}  small runs {small}  by head {by_head}  "
                       f"exact {exact}  {tbs:.2f} TB/s  {tbs / ref:.3f}")
    print("\n| warps x stages | a page's heads | runs a (page, head) | TB/s | vs in-order 64 KB |")
    print("|---|---|---|---|---|")
    for w, st, gr, sm, bh, ex, tbs, ratio in rows:
        runs = "K 1 KB, V 1 KB, K record 272 B, V codes 128 B" if sm else "K 1 KB, V 1 KB"
        runs += (", side by side a head" if bh else "") + (", loads as wide as each run" if ex else "")
        print(f"| {w} x {st} | {'together' if gr else 'apart'} | {runs} | {tbs:.2f} | {ratio:.3f} |")


def time_runs(buf: torch.Tensor, run: int, pad: int, order: str, warps: int, stages: int, reps: int) -> float:
    """TB/s of useful bytes for one configuration."""
    per = max(1, 65536 // run)
    n = TOTAL // run // per * per
    g = torch.Generator(device="cuda").manual_seed(run + pad)
    ids = torch.randperm(n, device="cuda", generator=g) if order == "random" else torch.arange(n, device="cuda")
    ids = ids.to(torch.int32)
    out = torch.empty(n // per, dtype=torch.int32, device="cuda")
    piece = min(run, 2048)
    stride = (run + pad) // 4

    def call():
        runs_kernel[(n // per,)](buf, ids, out, stride, RUN=run, PIECE=piece, PER=per, STAGES=stages,
                                 num_warps=warps)
    t = kb.time_ms(call, reps)
    return n * run / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="run lengths 2 KB and 64 KB only")
    ap.add_argument("--int4-pages", action="store_true", help="an INT4 chunk's four runs a (page, head)")
    a = ap.parse_args()
    read, _ = kb.read_bandwidth(5)
    kb.log(f"{torch.cuda.get_device_name()}: torch.sum read {read:.2f} TB/s")
    buf = torch.randint(0, 1 << 20, ((TOTAL + TOTAL // 8) // 4,), dtype=torch.int32, device="cuda")
    if a.int4_pages:
        int4_pages(buf, a.reps)
        return
    runs = (2048, 65536) if a.quick else (1024, 2048, 4096, 16384, 65536)
    rows = []
    for warps, stages in ((4, 3), (1, 1), (1, 3), (4, 1)):
        ref = time_runs(buf, 65536, 0, "seq", warps, stages, a.reps)
        for run in runs:
            for pad in (0, 64):
                for order in ("random", "seq"):
                    tbs = time_runs(buf, run, pad, order, warps, stages, a.reps)
                    rows.append((warps, stages, run, pad, order, tbs, tbs / ref))
                    kb.log(f"  {warps} warps x {stages} stages  run {run:6d}  pad {pad:2d}  {order:6s}  "
                           f"{tbs:.2f} TB/s  {tbs / ref:.3f}")
    print("\n| warps x stages | run bytes | pad | order | TB/s | vs in-order 64 KB |")
    print("|---|---|---|---|---|---|")
    for w, s, r, p, o, tbs, ratio in rows:
        print(f"| {w} x {s} | {r} | {p} | {o} | {tbs:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
