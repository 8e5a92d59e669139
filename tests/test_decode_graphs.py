"""Decode steps through fixed buffers (`engine/decode_batch.py`, `engine/decode_graphs.py`): the same
logits and the same cache as the per-step metadata path, with the batch padded to its graph size.

On the CPU the buffers run eagerly (everything but the capture: padding rows, the per-row write
plan, the scratch slot, the bucketed split choice); on a GPU (marked) the steps replay CUDA graphs
through the Triton kernels, against the same steps launched eagerly, and the engine generates the same
tokens with graphs as with --enforce-eager (a tiny random Llama)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvmesh.engine.decode_batch import DecodeBatch, DecodeShape
from kvmesh.engine.decode_graphs import DecodeGraphs, batch_sizes, context_bucket
from kvmesh.engine.inflight import TokenFeed
from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache
from kvmesh.kv.quant import dequantize_layer
from test_kernels_model import tiny_model

BS = 16
SLOTS = 8  # residual slots the sequences own; the graph cache has one more (the scratch slot)


def test_batch_sizes_and_context_buckets():
    assert batch_sizes(1) == (1,)
    assert batch_sizes(8) == (1, 2, 4, 8)
    assert batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert batch_sizes(64)[-3:] == (48, 56, 64)
    assert [context_bucket(c, 8192) for c in (1, 512, 513, 1024, 5000, 8192)] == [512, 512, 1024, 1024, 8192, 8192]
    assert context_bucket(3000, 2048) == 2048


def test_decode_batch_write_plan_rows():
    """Row i's plan: block id where its token completes a block (the block's residual rows, then its new
    row), its new row copied to its residual slot either way; padding rows write the scratch slot only."""
    shape = DecodeShape(rows=4, table_width=6, block_size=BS, num_slots=5, scratch_slot=4)
    batch = DecodeBatch(shape, torch.device("cpu"))
    seqs = [SeqSlice(15, 1, [7, 9], 2), SeqSlice(20, 1, [3, 1], 0), SeqSlice(47, 1, [5, 6, 8, 2], 1)]
    batch.fill([11, 12, 13], seqs)
    meta = batch.metadata(max_prefix_len=511)
    new_base = 5 * BS
    assert meta.prefix_lens.tolist() == [15, 20, 47, 0]
    assert meta.residual_slots.tolist() == [2, 0, 1, 4]
    assert meta.block_tables[:3, :4].tolist() == [[7, 9, 0, 0], [3, 1, 0, 0], [5, 6, 8, 2]]
    assert meta.write.block_ids.tolist() == [7, -1, 8, -1]
    assert meta.write.block_rows[0].tolist() == [2 * BS + j for j in range(BS - 1)] + [new_base]
    assert meta.write.block_rows[2].tolist() == [BS + j for j in range(BS - 1)] + [new_base + 2]
    assert meta.write.residual_src.tolist() == [new_base + i for i in range(4)]
    assert meta.write.residual_dst.tolist() == [2 * BS + 15, 0 * BS + 4, 1 * BS + 15, 4 * BS]
    assert batch.input_ids.tolist() == [11, 12, 13, 0] and batch.positions.tolist() == [15, 20, 47, 0]
    # async scheduling: rows whose token is still on the device take it over their placeholders
    batch.fill([11, 0, 0], seqs, feed=TokenFeed(torch.tensor([2, 1]), torch.tensor([42, 41])))
    assert batch.input_ids.tolist() == [11, 41, 42, 0]
    batch.fill([5], [SeqSlice(3, 1, [4], 3)])  # a smaller step: the rows it left are padding again
    assert meta.prefix_lens.tolist() == [3, 0, 0, 0] and meta.write.block_ids.tolist() == [-1] * 4
    assert meta.residual_slots.tolist() == [3, 4, 4, 4]
    with pytest.raises(ValueError, match="do not fit"):
        batch.fill([1] * 5, [SeqSlice(0, 1, [], 0)] * 5)


def test_decode_batch_stages_growing_tables_like_fresh_ones():
    """Rows fed the same table list again stage only its new pages: over random steps (tables that
    grow, sequences that finish, join, move rows, or come back with a new list after a preemption)
    every row's table equals what a fresh batch stages from the same step."""
    import random
    rng = random.Random(3)
    shape = DecodeShape(rows=8, table_width=9, block_size=BS, num_slots=20, scratch_slot=19)
    batch = DecodeBatch(shape, torch.device("cpu"))
    live = {}  # residual slot -> (table list, prefix)
    next_page = iter(range(1, 10 ** 6))
    for step in range(200):
        for slot in list(live):
            table, prefix = live[slot]
            if rng.random() < 0.05:
                del live[slot]  # finished
            elif rng.random() < 0.03:
                live[slot] = ([next(next_page) for _ in range(prefix // BS + 1)], prefix)  # preempted, back
            else:
                if (prefix + 1) % BS == 0 and len(table) < shape.table_width:
                    table.append(next(next_page))  # the block its next token starts
                live[slot] = (table, min(prefix + 1, BS * (shape.table_width - 1) - 1))
        while len(live) < 8 and rng.random() < 0.5:
            slot = rng.choice([s for s in range(19) if s not in live])
            prefix = rng.randrange(0, BS * 4)
            live[slot] = ([next(next_page) for _ in range(prefix // BS + 1)], prefix)
        order = list(live)
        rng.shuffle(order)  # rows move between steps
        seqs = [SeqSlice(live[s][1], 1, live[s][0], s) for s in order]
        batch.fill([1] * len(seqs), seqs)
        fresh = DecodeBatch(shape, torch.device("cpu"))
        fresh.fill([1] * len(seqs), seqs)
        got, want = batch.metadata(511).block_tables, fresh.metadata(511).block_tables
        for i, s in enumerate(seqs):
            n = len(s.block_table)
            assert got[i, :n].tolist() == want[i, :n].tolist() == s.block_table, (step, i)
        assert batch.metadata(511).write.block_ids.tolist() == fresh.metadata(511).write.block_ids.tolist()


def test_ragged_steps_take_a_work_list():
    """A step whose work list gives its longest sequence more splits than the bucket's uniform choice
    takes the ragged graph, its list filled with the step; uniform steps and small spreads do not."""
    model = tiny_model("cpu")
    layout = BlockLayout(num_layers=2, kv_heads=2, head_dim=32, block_size=BS, kv_dtype="fp32")
    graphs = DecodeGraphs(model, KVCache(layout, 8, 65, torch.float32), TorchBackend(), max_seqs=64,
                          max_context=8192, scratch_slot=64, capture=False)
    capacity = 64 + 132 * 8 // 2  # the rows plus a wave of units at 8 programs an SM (132 SMs, 2 KV heads)
    assert graphs._work_units(64) == capacity

    def step(lens):
        return [SeqSlice(p, 1, list(range(p // BS + 1)), i) for i, p in enumerate(lens)]
    assert graphs.ragged_splits(step([4000] * 64), 64, 4096) == 0  # uniform: one count serves them all
    # one 8K sequence among 1K ones: 8 splits for every sequence at the top of the bucket (uniform at
    # 8 an SM), or 32 for the long one (the most under 256 tokens a split), 4 for each short one
    assert graphs.ragged_splits(step([8191] + [1000] * 55), 64, 8192) == 32
    assert graphs.ragged_splits(step([600, 500]), 2, 1024) == 0  # the uniform graph splits it 4 ways
    assert graphs.ragged_splits(step([4000] + [1000] * 63), 64, 4096) == 0  # 15 splits: under 2.5 x 8
    batch = graphs._batch(64)
    batch.fill([1] * 56, step([8191] + [1000] * 55), 32)
    work = batch.metadata(8191, work=True).work
    units = [(e >> 16, (e >> 8) & 255, e & 255) for e in work.work.tolist()]
    assert work.units == capacity and units[:33] == [(0, s, 32) for s in range(32)] + [(1, 0, 4)]
    assert units[32 + 55 * 4:32 + 55 * 4 + 8] == [(56 + i, 0, 1) for i in range(8)]  # padding rows: one each
    assert units[32 + 55 * 4 + 8:] == [(0, 255, 255)] * (capacity - 32 - 55 * 4 - 8)
    assert batch.metadata(8191).work is None
    with pytest.raises(ValueError, match="no work list"):
        graphs._batch(1).metadata(511, work=True)


def _tiny_case(kv: str, lens: tuple[int, ...], seed: int):
    """(the tiny CPU model, its page layout for `kv`, random prompts of `lens` tokens, the generator)."""
    model = tiny_model("cpu")
    cfg = model.config
    layout = BlockLayout(num_layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         block_size=BS, kv_dtype=kv)
    rng = random.Random(seed)
    return model, layout, [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in lens], rng


@pytest.mark.parametrize("kv", ["fp32", "int8", "int4"])
def test_ragged_graph_path_through_the_triton_kernels(kv, monkeypatch):
    """The ragged graph's path end to end on the CPU (Triton's interpreter, no capture): the batch's
    work list, the metadata's fixed plan, the kernels over it and the second-launch reduction give
    the per-step path's logits, step after step. Thresholds lowered so short contexts split: 16
    tokens a split, a wave of 1 program an SM (few spare units: the interpreter is slow)."""
    from kvmesh.engine import decode_graphs
    from kvmesh.kernels.triton_backend import TritonBackend
    monkeypatch.setattr(decode_graphs, "MIN_TOKENS_PER_SPLIT", 16)
    monkeypatch.setattr(decode_graphs, "WORK_RESIDENT", 1)
    model, layout, prompts, rng = _tiny_case(kv, (120, 9, 30, 4, 17), seed=4)
    tables = [list(range(1 + 9 * i, 10 + 9 * i)) for i in range(5)]
    eager_cache = KVCache(layout, 48, SLOTS, torch.float32)
    graph_cache = KVCache(layout, 48, SLOTS + 1, torch.float32)
    graphs = DecodeGraphs(model, graph_cache, TritonBackend(), max_seqs=8, max_context=256, scratch_slot=SLOTS,
                          capture=False)
    eager = TritonBackend()
    a = _prefill(model, eager_cache, eager, prompts, tables)
    _prefill(model, graph_cache, graphs.backend, prompts, tables)
    tokens = a.argmax(-1).tolist()
    lens = [len(p) for p in prompts]
    for step in range(3):
        slices = [SeqSlice(lens[i], 1, tables[i], i) for i in range(5)]
        assert graphs.ragged_splits(slices, 8, 256) == 7  # ~121 tokens at 16 or more a split (uniform: 1)
        meta = build_attention_metadata(slices, layout, SLOTS, "cpu")
        want = model.compute_logits(model(torch.tensor(tokens), torch.tensor(lens), meta, eager_cache, eager),
                                    upcast=False)
        got = graphs.run(tokens, slices)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        tokens = want.argmax(-1).tolist()
        lens = [n + 1 for n in lens]


def _prefill(model, cache, backend, prompts, tables):
    """Each prompt's K/V into `cache` (one step), returns the last logits rows [B, vocab]."""
    slices = [SeqSlice(0, len(p), t, i) for i, (p, t) in enumerate(zip(prompts, tables))]
    meta = build_attention_metadata(slices, cache.layout, cache.num_residual_slots, cache.device)
    dev = cache.device
    ids = torch.tensor([x for p in prompts for x in p], device=dev)
    pos = torch.cat([torch.arange(len(p)) for p in prompts]).to(dev)
    hidden = model(ids, pos, meta, cache, backend)
    ends = torch.tensor([len(p) for p in prompts], device=dev).cumsum(0) - 1
    return model.compute_logits(hidden[ends])


@pytest.mark.parametrize("kv", ["fp32", "int8", "int4"])
def test_fixed_buffers_match_per_step_metadata(kv):
    """Greedy decode of 5 ragged sequences (batch 8 with padding, then 3 of them in batch 4) for 40
    steps, crossing block ends at different steps: the same tokens and logits as the per-step path,
    the same pages and residual tails; nothing written but the sequences' own slots and the scratch slot."""
    model, layout, prompts, rng = _tiny_case(kv, (5, 30, 16, 47, 63), seed=3)
    cfg = model.config
    pages = rng.sample(range(1, 60), 5 * 8)
    tables = [pages[8 * i:8 * i + 8] for i in range(5)]
    eager_cache = KVCache(layout, 64, SLOTS, torch.float32)
    graph_cache = KVCache(layout, 64, SLOTS + 1, torch.float32)
    eager, fixed = TorchBackend(), TorchBackend()
    graphs = DecodeGraphs(model, graph_cache, fixed, max_seqs=8, max_context=128, scratch_slot=SLOTS, capture=False)
    a = _prefill(model, eager_cache, eager, prompts, tables)
    b = _prefill(model, graph_cache, fixed, prompts, tables)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    tokens = a.argmax(-1).tolist()
    lens = [len(p) for p in prompts]
    live = list(range(5))
    for step in range(40):
        if step == 20:
            live = [0, 2, 4]  # a smaller batch: bucket 4, its 4th row padding
        slices = [SeqSlice(lens[i], 1, tables[i], i) for i in live]
        step_tokens = [tokens[i] for i in live]
        assert graphs.takes(slices, list(range(len(live))), [])
        meta = build_attention_metadata(slices, layout, SLOTS, "cpu")
        hidden = model(torch.tensor(step_tokens), torch.tensor([lens[i] for i in live]), meta, eager_cache, eager)
        want = model.compute_logits(hidden, upcast=False)
        got = graphs.run(step_tokens, slices)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for j, i in enumerate(live):
            tokens[i] = int(want[j].argmax())
            lens[i] += 1
    used = torch.tensor(sorted({p for t in tables for p in t}))
    tol = {"fp32": 1e-5, "int8": 0.02, "int4": 0.3}[kv]  # a code may round apart (batch shapes sum apart)
    for layer in range(cfg.num_layers):
        got = dequantize_layer(graph_cache.layer_view(layer), used, kv)
        want = dequantize_layer(eager_cache.layer_view(layer), used, kv)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=tol)
            assert (g - w).norm() <= 1e-2 * w.norm()
    for i in range(5):
        n = lens[i] % BS
        torch.testing.assert_close(graph_cache.residual[i][..., :n, :], eager_cache.residual[i][..., :n, :],
                                   rtol=1e-5, atol=1e-5)
    assert graph_cache.residual[5:SLOTS].abs().sum() == 0  # slots no sequence owns stay untouched
    assert graph_cache.residual[SLOTS].abs().sum() > 0  # the padding rows wrote their scratch slot


def test_steps_the_graphs_do_not_take():
    model = tiny_model("cpu")
    layout = BlockLayout(num_layers=2, kv_heads=2, head_dim=32, block_size=BS, kv_dtype="fp32")
    graphs = DecodeGraphs(model, KVCache(layout, 8, 3, torch.float32), TorchBackend(), max_seqs=2,
                          max_context=64, scratch_slot=2, capture=False)
    one = SeqSlice(10, 1, [1], 0)
    assert graphs.takes([one], [0], [])
    assert not graphs.takes([one, one, one], [0, 1, 2], [])  # more than --max-num-seqs
    assert not graphs.takes([SeqSlice(10, 2, [1], 0)], [0], [])  # a prompt chunk
    assert not graphs.takes([one], [0], [(0, 1, 0)])  # prompt logprobs
    assert not graphs.takes([SeqSlice(64, 1, [1, 2, 3, 4, 5], 0)], [0], [])  # context past the limit
    assert not graphs.takes([], [], [])


def _smollm2_shaped(layers: int = 4):
    """SmolLM2's attention shape (9 query heads over 3 KV heads, head_dim 64), fewer layers, random fp16."""
    from kvmesh.model.config import ModelConfig
    from kvmesh.model.llama import LlamaForCausalLM
    cfg = ModelConfig("LlamaForCausalLM", 576, layers, 9, 3, 64, 1536, 49152, 1e5, None, 1e-5, True, False,
                      8192, 1, (2,), "float16", "smollm2-shape")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return model.half().eval()


def _replays_against_eager(kv: str, lens: list[int], steps: int, live_after: dict[int, list[int]],
                           max_seqs: int, max_context: int) -> DecodeGraphs:
    """Greedy decode of prompts of `lens` tokens (SmolLM2's attention shape, random fp16) through the
    Triton kernels, `steps` steps (the live sequences change at the steps `live_after` names): each
    replay's logits within 3e-3 (relative L2) of the same step launched eagerly, the same greedy
    tokens, the pages and tails alike. Returns the graphs."""
    from kvmesh.kernels.triton_backend import TritonBackend
    model = _smollm2_shaped()
    cfg = model.config
    layout = BlockLayout(num_layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         block_size=BS, kv_dtype=kv)
    rng = random.Random(5)
    lens = list(lens)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in lens]
    widths = [-(-(n + steps + 1) // BS) for n in lens]
    pages = rng.sample(range(1, sum(widths) + 40), sum(widths))
    ends = np.cumsum(widths)
    tables = [pages[e - w:e] for e, w in zip(ends, widths)]
    slots = len(lens)
    eager_cache = KVCache(layout, sum(widths) + 40, slots, torch.float16, "cuda")
    graph_cache = KVCache(layout, sum(widths) + 40, slots + 1, torch.float16, "cuda")
    eager, fixed = TritonBackend(), TritonBackend()
    graphs = DecodeGraphs(model, graph_cache, fixed, max_seqs=max_seqs, max_context=max_context, scratch_slot=slots)
    with torch.inference_mode():
        a = _prefill(model, eager_cache, eager, prompts, tables)
        _prefill(model, graph_cache, fixed, prompts, tables)
        tokens = a.argmax(-1).tolist()
        live = list(range(len(lens)))
        for step in range(steps):
            live = live_after.get(step, live)
            slices = [SeqSlice(lens[i], 1, tables[i], i) for i in live]
            step_tokens = [tokens[i] for i in live]
            meta = build_attention_metadata(slices, layout, slots, "cuda")
            pos = torch.tensor([lens[i] for i in live], device="cuda")
            want = model.compute_logits(model(torch.tensor(step_tokens, device="cuda"), pos, meta, eager_cache,
                                              eager), upcast=False).float()
            got = graphs.run(step_tokens, slices).float()
            err = ((got - want).norm() / want.norm()).item()
            assert err < 3e-3, f"step {step}: logits {err:.2e} apart"
            for j, i in enumerate(live):
                tokens[i] = int(want[j].argmax())
                lens[i] += 1
    assert graphs.failed is None and graphs.replays == steps
    for i in range(len(lens)):
        n = lens[i] % BS
        torch.testing.assert_close(graph_cache.residual[i][..., :n, :], eager_cache.residual[i][..., :n, :],
                                   rtol=2e-2, atol=2e-2)
    used = torch.tensor(sorted({p for t, n in zip(tables, lens) for p in t[:n // BS]}), device="cuda")
    for layer in range(cfg.num_layers):
        for g, w in zip(dequantize_layer(graph_cache.layer_view(layer), used, kv),
                        dequantize_layer(eager_cache.layer_view(layer), used, kv)):
            assert (g - w).norm() <= 2e-2 * w.norm()
    return graphs


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp16", "fp8_e4m3", "int8", "int4"])
def test_gpu_graph_replays_equal_eager_steps(kv):
    """12 ragged sequences (batch 16, 4 padding rows), then 5 of them (batch 8), 48 steps across block
    ends and context buckets (prompts 30-668 tokens): one uniform graph per (batch, context bucket)."""
    rng = random.Random(5)
    lens = [rng.randrange(1, 700) for _ in range(11)] + [470]  # 470 + 24 + 24 crosses 512
    # step 24: the short ones, the 512 bucket, then 1,024 once the last passes 511 tokens
    graphs = _replays_against_eager(kv, lens, 48, {24: [1, 2, 5, 9, 11]}, max_seqs=16, max_context=2048)
    assert graphs.captured == [(8, 512, False), (8, 1024, False), (16, 1024, False)], graphs.captured


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp16", "fp8_e4m3", "int8", "int4"])
def test_gpu_ragged_graph_replays_equal_eager_steps(kv):
    """One 3,990-token sequence among 63 short ones (batch 64, bucket 4,096): the ragged graph, its
    work list splitting the long one 15 ways where the uniform choice gives every sequence 5; then
    the short ones alone (a uniform bucket-512 graph)."""
    rng = random.Random(9)
    lens = [3990] + [rng.randrange(20, 100) for _ in range(63)]
    graphs = _replays_against_eager(kv, lens, 16, {8: list(range(1, 64))}, max_seqs=64, max_context=4096)
    assert graphs.captured == [(64, 512, False), (64, 4096, True)], graphs.captured


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_gpu_engine_graphs_equal_enforce_eager(kv, tmp_path):
    """The engine with graphs (the default on a GPU) against --enforce-eager over a tiny random HF
    Llama (confident argmaxes): 11 prompts at --max-num-seqs 8, so batches of 8 and 3 (padded to 4)
    as requests finish and the queue refills: the same greedy tokens, and the graphs served the steps
    (the prompt steps too: the first 8 prompts in one, the last 3 joining running decodes)."""
    from test_engine_gpu import _run
    from test_engine_models import make_tiny_model, random_prompts
    make_tiny_model(tmp_path, "llama", seed=7)
    prompts = random_prompts(11, 5, 90, seed=2)
    runs = {}
    for eager in (True, False):
        runs[eager], eng = _run(str(tmp_path), "triton", kv, prompts, [20 + 3 * i for i in range(11)],
                                enforce_eager=eager, kv_cache_memory=16 << 20)
        graphs = eng.runner.graphs
        assert (graphs is None) == eager
        if not eager:  # every size captured at start at 512, and nothing longer was needed
            assert graphs.failed is None and graphs.replays > 20, graphs.failed
            assert graphs.captured == [(n, 512, False) for n in (1, 2, 4, 8)], graphs.captured
            chunks = eng.runner.chunk_graphs  # the prompt steps: every bucket captured at start
            assert chunks.failed is None and chunks.replays >= 2, chunks.failed
            assert chunks.captured == list(chunks.buckets), chunks.captured
        del eng
        torch.cuda.empty_cache()
    assert runs[False] == runs[True]
