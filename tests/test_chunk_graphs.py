"""Steps with prompt chunks through fixed buffers (`engine/chunk_batch.py`, `engine/chunk_graphs.py`):
the same logits and the same cache as the per-step metadata path, padded to the step's token bucket
and to `max_seqs` sequences, the prefill kernel over a tile list.

On the CPU the buffers run eagerly (everything but the capture), through the torch backend and
through the Triton kernels under the interpreter; on a GPU (marked) the steps replay CUDA graphs
against the same steps launched eagerly (the eager path splitting mixed steps, as the runner does)."""
from __future__ import annotations

import random

import pytest
import torch

from kvmesh.engine import chunk_graphs
from kvmesh.engine.chunk_batch import ChunkBatch, ChunkShape
from kvmesh.engine.chunk_graphs import ChunkGraphs, token_buckets
from kvmesh.engine.inflight import TokenFeed
from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata, build_write_plan
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache
from kvmesh.kv.quant import dequantize_layer
from test_kernels_model import tiny_model

BS = 16
SLOTS = 4  # residual slots the sequences own; the graph cache has one more (the scratch slot)
# (sequence, new tokens) per step: whole prompts, decode rows beside chunks, a chunk after a prefix
# that ends inside a block, a second turn's extend; 63 / 32 / 51 / 8 tokens: buckets 64, 32, 64, 16
SCHEDULE = [[(0, 40), (1, 23)], [(0, 1), (1, 1), (2, 30)], [(0, 1), (1, 1), (2, 40), (3, 9)],
            [(0, 1), (1, 1), (2, 1), (3, 5)]]


def test_token_buckets():
    assert token_buckets(2048) == (256, 512, 1024, 2048)
    assert token_buckets(8192) == (256, 512, 1024, 2048, 4096, 6144, 8192)
    assert token_buckets(5000) == (256, 512, 1024, 2048, 4096, 5000)
    assert token_buckets(300) == (256, 300)


def test_chunk_batch_matches_the_per_step_write_plan():
    """The fixed plan holds build_write_plan's entries in its order, then spares (page -1, residual
    row -1); the tile list holds every sequence's tiles, the most keys first."""
    shape = ChunkShape(tokens=64, rows=6, table_width=8, block_size=BS, num_slots=5, scratch_slot=4, tile_tokens=8)
    batch = ChunkBatch(shape, torch.device("cpu"))
    seqs = [SeqSlice(15, 1, [7, 9], 2), SeqSlice(0, 40, [3, 1, 6], 0), SeqSlice(20, 20, [5, 8, 2], 1),
            SeqSlice(47, 1, [10, 11, 12], 3)]
    chunks = [[1], list(range(40)), list(range(20)), [2]]
    batch.fill(chunks, seqs, [0, 40, 60, 61])
    meta = batch.metadata()
    want = build_write_plan(seqs, BS, 5, [0, 1, 41, 61])
    nb, m = want.block_ids.shape[0], want.residual_src.shape[0]
    w = meta.write
    assert w.block_ids[:nb].tolist() == want.block_ids.tolist() and w.block_ids[nb:].eq(-1).all()
    assert w.block_rows[:nb].tolist() == want.block_rows.tolist()
    assert w.block_ids.shape[0] == 64 // BS + 6
    assert w.residual_src[:m].tolist() == want.residual_src.tolist() and w.residual_src[m:].eq(5 * BS).all()
    assert w.residual_dst[:m].tolist() == want.residual_dst.tolist() and w.residual_dst[m:].eq(-1).all()
    assert w.residual_src.shape[0] == min(64, 6 * (BS - 1))
    assert meta.query_start_loc.tolist() == [0, 1, 41, 61, 62, 62, 62]
    assert meta.prefix_lens.tolist() == [15, 0, 20, 47, 0, 0] and meta.residual_slots.tolist() == [2, 0, 1, 3, 4, 4]
    assert batch.positions[:62].tolist() == [15] + list(range(40)) + list(range(20, 40)) + [47]
    assert batch.input_ids[:62].tolist() == [c for ch in chunks for c in ch]
    assert batch.logit_rows.tolist() == [0, 40, 60, 61, 0, 0]
    tiles = [(e >> 16, e & 0xFFFF) for e in meta.tiles.tolist() if e >= 0]
    # keys of each tile's last row: (3, 0) 48, (1, 4) and (2, 2) 40, (2, 1) 36, (1, 3) 32, ...
    assert tiles == [(3, 0), (1, 4), (2, 2), (2, 1), (1, 3), (2, 0), (1, 2), (0, 0), (1, 1), (1, 0)]
    assert meta.tiles.shape[0] == 64 // 8 + 6 and meta.max_query_len == 64
    # async scheduling: a decode row's token still on the device takes its placeholder's row
    batch.fill([[0], list(range(40)), list(range(20)), [2]], seqs, [0, 40, 60, 61],
               feed=TokenFeed(torch.tensor([0]), torch.tensor([77])))
    assert batch.input_ids[:2].tolist() == [77, 0] and batch.input_ids[61].item() == 2
    batch.fill([[5]], [SeqSlice(3, 1, [4], 3)], [0])  # a smaller step: the rest is padding again
    assert meta.write.block_ids.eq(-1).all() and meta.residual_slots.tolist() == [3, 4, 4, 4, 4, 4]
    assert [e for e in meta.tiles.tolist() if e >= 0] == [0]
    with pytest.raises(ValueError, match="do not fit"):
        batch.fill([[1] * 65], [SeqSlice(0, 65, [1] * 5, 0)], [64])


def test_steps_the_graphs_do_not_take():
    model = tiny_model("cpu")
    layout = BlockLayout(num_layers=2, kv_heads=2, head_dim=32, block_size=BS, kv_dtype="fp32")
    graphs = ChunkGraphs(model, KVCache(layout, 8, 3, torch.float32), TorchBackend(), max_seqs=2, max_tokens=300,
                         max_context=64, scratch_slot=2, capture=False)
    chunk = SeqSlice(0, 20, [1], 0)
    assert graphs.takes([chunk, SeqSlice(10, 1, [1], 1)], [0, 1], [])
    assert not graphs.takes([SeqSlice(10, 1, [1], 0)], [0], [])  # a decode step: the decode graphs'
    assert not graphs.takes([chunk] * 3, [0, 1, 2], [])  # more than max_seqs
    assert not graphs.takes([chunk], [0], [(0, 19, 0)])  # prompt logprobs
    assert not graphs.takes([SeqSlice(0, 301, [1] * 19, 0)], [0], [])  # past the largest bucket
    assert not graphs.takes([SeqSlice(50, 20, [1] * 5, 0)], [0], [])  # context past the limit


def _replay_schedule(kv: str, backend_of, device: str, split_mixed: bool, tol: float):
    """SCHEDULE through per-step metadata (eager) and through the chunk graphs' buffers (on the CPU
    run eagerly), each on its own cache: the sampled rows' logits within `tol` (relative L2), then
    the pages and tails alike, the unowned slots untouched. Returns the graphs."""
    model = tiny_model(device)
    cfg = model.config
    layout = BlockLayout(num_layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         block_size=BS, kv_dtype=kv)
    rng = random.Random(11)
    tokens = [[rng.randrange(cfg.vocab_size) for _ in range(80)] for _ in range(SLOTS)]
    pages = rng.sample(range(1, 40), SLOTS * 8)
    tables = [pages[8 * i:8 * i + 8] for i in range(SLOTS)]
    eager_cache = KVCache(layout, 40, SLOTS, torch.float32, device)
    graph_cache = KVCache(layout, 40, SLOTS + 1, torch.float32, device)
    eager = backend_of()
    graphs = ChunkGraphs(model, graph_cache, backend_of(), max_seqs=6, max_tokens=96, max_context=128,
                         scratch_slot=SLOTS, capture=device == "cuda")
    done = [0] * SLOTS
    with torch.inference_mode():
        for step in SCHEDULE:
            slices = [SeqSlice(done[i], n, tables[i], i) for i, n in step]
            chunks = [tokens[i][done[i]:done[i] + n] for i, n in step]
            rows = [sum(n for _, n in step[:j + 1]) - 1 for j in range(len(step))]
            assert graphs.takes(slices, rows, [])
            meta = build_attention_metadata(slices, layout, SLOTS, device, split_mixed=split_mixed)
            ids = torch.tensor([t for c in chunks for t in c], device=device)
            pos = torch.tensor([done[i] + j for i, n in step for j in range(n)], device=device)
            want = model.compute_logits(model(ids, pos, meta, eager_cache, eager)[rows], upcast=False)
            got = graphs.run(chunks, slices, rows)
            assert got.shape == want.shape
            assert (got - want).norm() <= tol * want.norm(), f"{step}: {((got - want).norm() / want.norm()):.2e}"
            for i, n in step:
                done[i] += n
    used = torch.tensor(sorted({p for t, n in zip(tables, done) for p in t[:n // BS]}), device=device)
    for layer in range(cfg.num_layers):
        for g, w in zip(dequantize_layer(graph_cache.layer_view(layer), used, kv),
                        dequantize_layer(eager_cache.layer_view(layer), used, kv)):
            assert (g - w).norm() <= 1e-2 * w.norm()
    # past layer 0 a tail row comes from layers that read quantized pages: a code that rounds apart
    # (the GPU's GEMMs sum a padded batch in another order) moves it, 9e-4 at most at int4
    tail_tol = 1e-5 if device == "cpu" else 1e-2
    for i in range(SLOTS):
        n = done[i] % BS
        got, want = graph_cache.residual[i][..., :n, :], eager_cache.residual[i][..., :n, :]
        assert (got - want).norm() <= tail_tol * want.norm()
    return graphs, graph_cache


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(chunk_graphs, "SMALL_BUCKETS", (16, 32))
    monkeypatch.setattr(chunk_graphs, "BUCKET_STEP", 32)


@pytest.mark.parametrize("kv", ["fp32", "int8", "int4"])
def test_fixed_buffers_match_per_step_metadata(kv, small_buckets):
    graphs, cache = _replay_schedule(kv, TorchBackend, "cpu", False, 1e-5)
    assert graphs.buckets == (16, 32, 64, 96)
    assert cache.residual[SLOTS].abs().sum() == 0  # spare entries write nothing, not even the scratch slot


@pytest.mark.parametrize("kv", ["fp32", "fp8_e4m3", "int4"])
def test_tile_list_through_the_triton_kernels(kv, small_buckets):
    """The prefill kernel over the tile list (decode rows in it too) against the eager Triton path,
    which sends a mixed step's decode rows to the decode kernel (Triton's interpreter)."""
    from kvmesh.kernels.triton_backend import TritonBackend
    _replay_schedule(kv, TritonBackend, "cpu", True, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "int8", "int4"])
def test_gpu_chunk_graph_replays_equal_eager_steps(kv, small_buckets):
    from kvmesh.kernels.triton_backend import TritonBackend
    graphs, _ = _replay_schedule("fp32" if kv == "auto" else kv, TritonBackend, "cuda", True, 1e-3)
    assert graphs.failed is None and graphs.replays == len(SCHEDULE) and graphs.captured == [16, 32, 64]
