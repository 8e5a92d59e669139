"""Whole decode steps, eager against CUDA graphs (H200): the engine's step as `ModelRunner.execute` runs
it, random bf16 weights, pages in random order, every sequence at the same context.

    python benchmarks/decode_step.py [--reps 20] [--shapes smollm2,llama3-8b] [--out table.md] [--profile]

Eager: the step's metadata built on the host (`build_attention_metadata`), then the model and the
logits kernel by kernel. Graphs: the step's inputs staged into fixed buffers (`DecodeBatch.fill`)
and its graph replayed (`DecodeGraphs.run`; captured before timing, the first step's time, with
the capture, in the last column). Wall time a step, host
included (what a serving loop waits), median of --reps after a warm-up; the roofline is the bytes a
step must read (weights + KV pages with their scales) at the read bandwidth `torch.sum` reaches here.
Beside it, the same graphs captured without the twenty-third session's fusions (`unfused`: the residual
rows' copy as a second launch of the cache write; FP8's key centers subtracted by their own kernel;
FP8 rows run with random key centers, as the engine centers FP8 keys). --profile prints each
shape's first case's kernels an eager step and a graph step (by name: the graph's).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import random
import statistics
import time

import torch

from kernels import _make_importable  # noqa: E402  (maps kvmesh to shared/ without the install)

_make_importable()

from kvmesh.engine.decode_graphs import DecodeGraphs  # noqa: E402
from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata  # noqa: E402
from kvmesh.kernels.triton_backend import TritonBackend  # noqa: E402
from kvmesh.kv.layout import BlockLayout  # noqa: E402
from kvmesh.kv.pool import KVCache  # noqa: E402
from kvmesh.model import llama  # noqa: E402
from kvmesh.model.config import ModelConfig  # noqa: E402
from kvmesh.model.key_centers import centers_keys  # noqa: E402
from kvmesh.model.llama import LlamaForCausalLM  # noqa: E402

SHAPES = {  # hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied
    "smollm2": (576, 30, 9, 3, 64, 1536, 49152, True),
    "llama3-8b": (4096, 32, 32, 8, 128, 14336, 128256, False),
}
CASES = {  # (batch, context) per shape, KV dtypes
    "smollm2": ([(1, 512), (16, 512), (64, 512), (64, 2048), (256, 1024)], ["bf16", "int4"]),
    "llama3-8b": ([(1, 2048), (32, 2048), (128, 2048)], ["bf16", "fp8_e4m3", "int4"]),
}
BS = 16


def read_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.float32, device="cuda")
    x.normal_()
    ts = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return 4 * x.numel() / min(ts)


def model_of(name: str) -> LlamaForCausalLM:
    h, layers, heads, kvh, d, inter, vocab, tied = SHAPES[name]
    cfg = ModelConfig("LlamaForCausalLM", h, layers, heads, kvh, d, inter, vocab, 5e5, None, 1e-5, tied, False,
                      8192, 1, (2,), "bfloat16", name)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model.eval()


@contextlib.contextmanager
def unfused():
    """The step as it ran before the twenty-third session's fusions, for a side-by-side column: a
    decode batch's residual rows copied by a launch of their own after the blocks' (a plan not
    `paired`), and FP8's key centers subtracted by their own kernel after the rotation. (The
    twenty-second session's column took away the gated SiLU, the residual add inside the GEMMs and
    the plain kernel's fused split reduction: docs/benchmarks.md.)"""
    write, rotary = TritonBackend.write, llama.RotaryEmbedding

    def separate_write(self, cache, layer, k, v, meta):
        write(self, cache, layer, k, v, dataclasses.replace(meta, write=dataclasses.replace(meta.write, paired=False)))

    class SeparateCenters(rotary):
        @staticmethod
        def apply(x, cos, sin, key_center=None):
            qk = rotary.apply(x, cos, sin)
            return qk if key_center is None else llama.center_keys(qk, key_center)

    TritonBackend.write, llama.RotaryEmbedding = separate_write, SeparateCenters
    try:
        yield
    finally:
        TritonBackend.write, llama.RotaryEmbedding = write, rotary


def kernel_counts(fn) -> collections.Counter:
    """Kernels one call of fn launches, by name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if e.device_type.name == "CUDA"
                               and not e.name.startswith(("Memcpy", "Memset")))


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def eager_step(model, cache: KVCache, backend, slices: list[SeqSlice], tokens: list[int]):
    """The step as the runner launches it without graphs: metadata built on the host, then the model
    and the logits kernel by kernel."""
    def step():
        meta = build_attention_metadata(slices, cache.layout, cache.num_residual_slots, "cuda")
        ids = torch.tensor(tokens, dtype=torch.long, device="cuda")
        pos = torch.tensor([s.prefix_len for s in slices], dtype=torch.long, device="cuda")
        return model.compute_logits(model(ids, pos, meta, cache, backend), upcast=False)
    return step


def run_case(model, name: str, kv: str, batch: int, ctx: int, reps: int, bandwidth: float, profile: bool) -> str:
    cfg = model.config
    layout = BlockLayout(num_layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         block_size=BS, kv_dtype=kv)
    per_seq = -(-(ctx + 1) // BS)
    pages = list(range(batch * per_seq))
    random.Random(0).shuffle(pages)
    tables = [pages[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    cache = KVCache(layout, batch * per_seq, batch + 1, torch.bfloat16, "cuda")
    cache.pool.random_(0, 256)  # timing only: any bytes stream the same
    backend = TritonBackend()
    # FP8 and INT4 keys are centered in the engine (model/key_centers.py); random centers cost the same
    g = torch.Generator().manual_seed(1)
    model.set_key_centers(torch.randn(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, generator=g) * 0.1
                          if centers_keys(kv) else None)

    def new_graphs():
        return DecodeGraphs(model, cache, backend, max_seqs=batch, max_context=max(ctx + 1, 512), scratch_slot=batch)

    graphs = new_graphs()
    slices = [SeqSlice(ctx - 1, 1, tables[i], i) for i in range(batch)]  # prefix ctx - 1 + the new token
    tokens = [random.Random(i).randrange(cfg.vocab_size) for i in range(batch)]

    eager = eager_step(model, cache, backend, slices, tokens)
    with torch.inference_mode():
        t_eager = timed(eager, reps)
        torch.cuda.synchronize()
        t = time.perf_counter()
        graphs.run(tokens, slices)  # captures: two warm-up steps, the capture, one replay
        torch.cuda.synchronize()
        t_capture = time.perf_counter() - t
        assert graphs.failed is None, graphs.failed
        t_graph = timed(lambda: graphs.run(tokens, slices), reps)
        with unfused():
            before = new_graphs()
            t_before = timed(lambda: before.run(tokens, slices), reps)
            assert before.failed is None, before.failed
            if profile:
                old, old_graph = kernel_counts(eager), kernel_counts(lambda: before.run(tokens, slices))
        if profile:
            new, new_graph = kernel_counts(eager), kernel_counts(lambda: graphs.run(tokens, slices))
            print(f"kernels an eager step, {name} {kv} batch {batch}: {sum(new.values())} "
                  f"(unfused: {sum(old.values())}); a graph step: {sum(new_graph.values())} "
                  f"(unfused: {sum(old_graph.values())})", flush=True)
            for k, n in new_graph.most_common(25):
                print(f"  {n:5d} {k[:110]}", flush=True)
        del before
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = batch * ctx * layout.bytes_per_token
    roof = (weights + kv_bytes) / bandwidth
    del cache, graphs
    torch.cuda.empty_cache()
    return (f"| {name} | {kv} | {batch} | {ctx} | {t_eager * 1e3:.2f} | {t_graph * 1e3:.2f} | "
            f"{t_before * 1e3:.2f} | {t_before / t_graph:.3f} | "
            f"{t_eager / t_graph:.2f}x | {roof * 1e3:.2f} | {100 * roof / t_graph:.0f} % | "
            f"{batch / t_graph:.0f} | {t_capture * 1e3:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="kernel counts of each shape's first case")
    args = ap.parse_args()
    bw = read_bandwidth()
    lines = [f"read bandwidth (torch.sum, 4 GiB): {bw / 1e12:.2f} TB/s", "",
             "| model shape | kv | batch | context | eager ms/step | graphs ms/step | graphs, unfused ms | "
             "unfused ÷ fused | speedup | roofline ms | graphs % of roofline | tokens/s (graphs) | "
             "first step, with its capture, ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def rows_of(model, name):
        cases, dtypes = CASES[name]
        for kv in dtypes:
            for i, (batch, ctx) in enumerate(cases):
                yield (f"{name} | {kv} | {batch} | {ctx}",
                       lambda: run_case(model, name, kv, batch, ctx, args.reps, bw, args.profile and i == 0))
    print_rows(lines, args.shapes.split(","), rows_of, args.out)


def print_rows(lines: list[str], shapes: list[str], rows_of, out: str | None) -> None:
    """Prints the table's head (`lines`) and a row per case, shape by shape: rows_of(model, name)
    yields (the row's first cells, a function making the row); a failed case costs its row, not the
    run. Writes the table to `out` too."""
    print("\n".join(lines), flush=True)
    for name in shapes:
        model = model_of(name)
        for label, make_row in rows_of(model, name):
            try:
                line = make_row()
            except Exception as e:
                line = f"| {label} | failed: {type(e).__name__}: {str(e)[:200]} |"
            print(line, flush=True)
            lines.append(line)
        del model
        torch.cuda.empty_cache()
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
