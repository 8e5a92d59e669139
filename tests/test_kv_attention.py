"""TorchBackend vs naive dense attention over the dequantized cache, and the write plan."""
from __future__ import annotations

import zlib

import pytest
import torch

from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata, pad_write_plan
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache
from kvmesh.kv.quant import dequantize_layer, quantize_blocks, store_blocks

torch.set_num_threads(1)
DTYPES = ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
BS, D, LAYERS, NUM_BLOCKS, SLOTS = 8, 32, 2, 40, 6


def make_cache(kv_dtype: str, kv_heads: int, gen: torch.Generator) -> KVCache:
    """A cache whose every page and residual slot holds fresh random data."""
    layout = BlockLayout(LAYERS, kv_heads, D, BS, kv_dtype)
    cache = KVCache(layout, NUM_BLOCKS, SLOTS, torch.float32)
    for layer in range(LAYERS):
        k = torch.randn(NUM_BLOCKS, BS, kv_heads, D, generator=gen)
        v = torch.randn(NUM_BLOCKS, BS, kv_heads, D, generator=gen)
        store_blocks(cache.layer_view(layer), torch.arange(NUM_BLOCKS), quantize_blocks(k, v, kv_dtype))
    cache.residual.copy_(torch.randn(cache.residual.shape, generator=gen))
    return cache


def make_slices(specs: list[tuple[int, int]], gen: torch.Generator) -> list[SeqSlice]:
    """specs: (prefix_len, num_new) per sequence; pages and slots are distinct random picks."""
    pages = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    slots = torch.randperm(SLOTS, generator=gen).tolist()
    out = []
    for i, (p, n) in enumerate(specs):
        nb = (p + n) // BS
        out.append(SeqSlice(p, n, [pages.pop() for _ in range(nb)], slots[i]))
    return out


def reference_attend(cache, layer, q, k, v, seqs, scale) -> torch.Tensor:
    """Naive: per sequence, per query token, dense softmax over dequantized pages + residual + new."""
    L = cache.layout
    out = torch.zeros(q.shape, dtype=torch.float32)
    start = 0
    for s in seqs:
        full = s.prefix_len // BS
        tail = s.prefix_len % BS
        ks, vs = [], []
        if full:
            pk, pv = dequantize_layer(cache.layer_view(layer), torch.tensor(s.block_table[:full]), L.kv_dtype)
            ks.append(pk.transpose(1, 2).reshape(-1, L.kv_heads, D))
            vs.append(pv.transpose(1, 2).reshape(-1, L.kv_heads, D))
        ks.append(cache.residual[s.residual_slot, layer, 0, :, :tail].transpose(0, 1).float())
        vs.append(cache.residual[s.residual_slot, layer, 1, :, :tail].transpose(0, 1).float())
        ks.append(k[start:start + s.num_new].float())
        vs.append(v[start:start + s.num_new].float())
        K, V = torch.cat(ks), torch.cat(vs)  # [ctx, KVH, D]
        rep = q.shape[1] // L.kv_heads
        K, V = K.repeat_interleave(rep, dim=1), V.repeat_interleave(rep, dim=1)  # [ctx, H, D]
        for j in range(s.num_new):
            n_ctx = s.prefix_len + j + 1
            sc = torch.einsum("hd,lhd->hl", q[start + j].float(), K[:n_ctx]) * scale
            out[start + j] = torch.einsum("hl,lhd->hd", torch.softmax(sc, -1), V[:n_ctx])
        start += s.num_new
    return out


CASES = {
    "prefill": [(0, 19), (0, 8)],
    "chunked_with_residual": [(13, 11), (16, 5), (5, 3)],
    "decode": [(0, 1), (7, 1), (8, 1), (23, 1), (31, 1)],
    "mixed": [(21, 1), (3, 14), (40, 1), (9, 2)],
}


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_attend_matches_dense_reference(kv_dtype, group, case):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kv_dtype}/{group}/{case}".encode()))  # reproducible
    kv_heads = 2
    cache = make_cache(kv_dtype, kv_heads, gen)
    seqs = make_slices(CASES[case], gen)
    T = sum(s.num_new for s in seqs)
    q = torch.randn(T, kv_heads * group, D, generator=gen)
    k = torch.randn(T, kv_heads, D, generator=gen)
    v = torch.randn(T, kv_heads, D, generator=gen)
    meta = build_attention_metadata(seqs, cache.layout, SLOTS, "cpu")
    got = TorchBackend().attend(cache, 1, q, k, v, meta, D ** -0.5)
    want = reference_attend(cache, 1, q, k, v, seqs, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def expected_block_bytes(kv_dtype: str, rows_k: torch.Tensor, rows_v: torch.Tensor, kv_heads: int) -> bytes:
    """The page bytes (one layer's regions) that quantizing these rows must produce."""
    layout = BlockLayout(LAYERS, kv_heads, D, BS, kv_dtype)
    scratch = KVCache(layout, 1, 1, torch.float32)
    store_blocks(scratch.layer_view(1), torch.tensor([0]), quantize_blocks(rows_k[None], rows_v[None], kv_dtype))
    return scratch.pool[0].view(LAYERS, layout.layer_bytes)[1]


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("prefix,new", [(8, 8), (5, 21), (0, 3), (3, 5), (14, 1), (15, 1)])
def test_write_plan_completes_blocks_and_keeps_tail(kv_dtype, prefix, new):
    gen = torch.Generator().manual_seed(prefix * 100 + new)
    kv_heads = 3
    cache = make_cache(kv_dtype, kv_heads, gen)
    (s,) = make_slices([(prefix, new)], gen)
    k = torch.randn(new, kv_heads, D, generator=gen)
    v = torch.randn(new, kv_heads, D, generator=gen)
    meta = build_attention_metadata([s], cache.layout, SLOTS, "cpu")
    # the full-precision token stream of this sequence from its first partial block on
    first = prefix // BS
    res = cache.residual[s.residual_slot, 1].clone()  # [2, KVH, bs, D]
    tail = prefix % BS
    stream_k = torch.cat([res[0, :, :tail].transpose(0, 1), k])  # [tail + new, KVH, D]
    stream_v = torch.cat([res[1, :, :tail].transpose(0, 1), v])
    pool_before = cache.pool.clone()
    layer_bytes = cache.layout.layer_bytes

    TorchBackend().write(cache, 1, k, v, meta)

    end = prefix + new
    done = end // BS - first
    assert meta.write.block_ids.tolist() == s.block_table[first:end // BS]
    for b in range(done):
        page = s.block_table[first + b]
        want = expected_block_bytes(kv_dtype, stream_k[b * BS:(b + 1) * BS], stream_v[b * BS:(b + 1) * BS], kv_heads)
        assert torch.equal(cache.pool[page].view(LAYERS, layer_bytes)[1], want)
        assert torch.equal(cache.pool[page].view(LAYERS, layer_bytes)[0], pool_before[page].view(LAYERS, layer_bytes)[0])
    untouched = [i for i in range(NUM_BLOCKS) if i not in s.block_table[first:end // BS]]
    assert torch.equal(cache.pool[untouched], pool_before[untouched])
    left = end % BS if done else new  # tokens that must now sit in the residual slot
    new_res = cache.residual[s.residual_slot, 1]
    lo = 0 if done else tail
    assert torch.equal(new_res[0, :, lo:lo + left].transpose(0, 1), stream_k[len(stream_k) - left:])
    assert torch.equal(new_res[1, :, lo:lo + left].transpose(0, 1), stream_v[len(stream_v) - left:])
    if not done:  # earlier tail tokens stay where they were
        assert torch.equal(new_res[:, :, :tail], res[:, :, :tail])


def test_write_plan_skips_padding_blocks():
    gen = torch.Generator().manual_seed(7)
    cache = make_cache("int8", 2, gen)
    seqs = make_slices([(4, 12), (0, 8)], gen)
    k = torch.randn(20, 2, D, generator=gen)
    v = torch.randn(20, 2, D, generator=gen)
    meta = build_attention_metadata(seqs, cache.layout, SLOTS, "cpu")
    ref = KVCache(cache.layout, NUM_BLOCKS, SLOTS, torch.float32)
    ref.pool.copy_(cache.pool)
    ref.residual.copy_(cache.residual)
    TorchBackend().write(ref, 0, k, v, meta)
    meta.write = pad_write_plan(meta.write, 6)
    assert meta.write.block_ids.tolist()[-3:] == [-1, -1, -1]
    TorchBackend().write(cache, 0, k, v, meta)
    assert torch.equal(cache.pool, ref.pool)
    assert torch.equal(cache.residual, ref.residual)
    # row math: seq 0 completes block 0 from 4 residual rows + 4 new rows, then 8 new rows
    slot0 = seqs[0].residual_slot
    base = SLOTS * BS
    assert meta.write.block_rows[0].tolist() == [slot0 * BS + i for i in range(4)] + [base + i for i in range(4)]
    assert meta.write.block_rows[1].tolist() == [base + 4 + i for i in range(8)]
    assert meta.write.block_rows[2].tolist() == [base + 12 + i for i in range(8)]
    assert meta.write.residual_src.numel() == 0


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_chunked_steps_match_dense_attention_over_quantized_blocks(kv_dtype):
    """A sequence fed in chunks (prefill, chunk, decodes) through attend+write equals dense attention
    over: full blocks = dequantize(quantize(raw)), tail = raw."""
    gen = torch.Generator().manual_seed(len(kv_dtype))
    kv_heads, group = 2, 3
    layout = BlockLayout(LAYERS, kv_heads, D, BS, kv_dtype)
    cache = KVCache(layout, NUM_BLOCKS, SLOTS, torch.float32)
    chunks = [7, 9, 1, 1, 13, 1, 8]
    N = sum(chunks)
    K = torch.randn(N, kv_heads, D, generator=gen)
    V = torch.randn(N, kv_heads, D, generator=gen)
    Q = torch.randn(N, kv_heads * group, D, generator=gen)
    table = torch.randperm(NUM_BLOCKS, generator=gen)[:N // BS + 1].tolist()
    Kq, Vq = K.clone(), V.clone()  # what the cache should hold once blocks are complete
    nfull = N // BS
    qk, qv = dequantize_layer(_view_of(quantize_blocks(K[:nfull * BS].view(nfull, BS, kv_heads, D),
                                                       V[:nfull * BS].view(nfull, BS, kv_heads, D), kv_dtype)),
                              torch.arange(nfull), kv_dtype)
    Kq[:nfull * BS] = qk.transpose(1, 2).reshape(-1, kv_heads, D)
    Vq[:nfull * BS] = qv.transpose(1, 2).reshape(-1, kv_heads, D)
    backend, p = TorchBackend(), 0
    for n in chunks:
        s = SeqSlice(p, n, table[:(p + n) // BS], 2)
        meta = build_attention_metadata([s], layout, SLOTS, "cpu")
        got = backend.attend(cache, 0, Q[p:p + n], K[p:p + n], V[p:p + n], meta, D ** -0.5)
        backend.write(cache, 0, K[p:p + n], V[p:p + n], meta)
        done = p // BS * BS  # tokens in completed (quantized) blocks when this step attended
        ctxK = torch.cat([Kq[:done], K[done:p + n]]).repeat_interleave(group, 1)
        ctxV = torch.cat([Vq[:done], V[done:p + n]]).repeat_interleave(group, 1)
        sc = torch.einsum("qhd,lhd->hql", Q[p:p + n], ctxK) * D ** -0.5
        mask = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]
        want = torch.einsum("hql,lhd->qhd", torch.softmax(sc.masked_fill(~mask, float("-inf")), -1), ctxV)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        p += n


def _view_of(qb):
    from kvmesh.kv.pool import LayerView
    return LayerView(qb.k, qb.v, qb.k_scale, qb.v_scale)


def test_long_prefill_uses_query_chunks_and_matches():
    """More new tokens than one query chunk (512), after a cached prefix with a residual tail."""
    gen = torch.Generator().manual_seed(11)
    layout = BlockLayout(LAYERS, 1, D, BS, "int8")
    big = KVCache(layout, (13 + 530) // BS + 1, SLOTS, torch.float32)
    for layer in range(LAYERS):  # valid scales: quantize fresh blocks into every page
        n = big.num_blocks
        store_blocks(big.layer_view(layer), torch.arange(n),
                     quantize_blocks(torch.randn(n, BS, 1, D, generator=gen), torch.randn(n, BS, 1, D, generator=gen), "int8"))
    big.residual.copy_(torch.randn(big.residual.shape, generator=gen))
    seqs = [SeqSlice(13, 530, torch.randperm(big.num_blocks, generator=gen)[:(13 + 530) // BS].tolist(), 3)]
    q = torch.randn(530, 2, D, generator=gen)
    k = torch.randn(530, 1, D, generator=gen)
    v = torch.randn(530, 1, D, generator=gen)
    meta = build_attention_metadata(seqs, layout, SLOTS, "cpu")
    got = TorchBackend().attend(big, 0, q, k, v, meta, D ** -0.5)
    want = reference_attend(big, 0, q, k, v, seqs, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_dtype(model_dtype):
    """Residual slots and q/k/v in the model's half dtype; softmax still accumulates in fp32."""
    gen = torch.Generator().manual_seed(12)
    layout = BlockLayout(LAYERS, 2, D, BS, "fp8_e4m3")
    cache = KVCache(layout, NUM_BLOCKS, SLOTS, model_dtype)
    for layer in range(LAYERS):
        store_blocks(cache.layer_view(layer), torch.arange(NUM_BLOCKS),
                     quantize_blocks(torch.randn(NUM_BLOCKS, BS, 2, D, generator=gen),
                                     torch.randn(NUM_BLOCKS, BS, 2, D, generator=gen), "fp8_e4m3"))
    cache.residual.copy_(torch.randn(cache.residual.shape, generator=gen))
    seqs = make_slices([(13, 11), (21, 1), (0, 5)], gen)
    q = torch.randn(17, 4, D, generator=gen).to(model_dtype)
    k = torch.randn(17, 2, D, generator=gen).to(model_dtype)
    v = torch.randn(17, 2, D, generator=gen).to(model_dtype)
    meta = build_attention_metadata(seqs, layout, SLOTS, "cpu")
    got = TorchBackend().attend(cache, 0, q, k, v, meta, D ** -0.5)
    assert got.dtype == model_dtype
    want = reference_attend(cache, 0, q, k, v, seqs, D ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    TorchBackend().write(cache, 0, k, v, meta)
    s = seqs[0]  # 13 + 11 = 24: blocks 1 and 2 complete, no tail left
    assert meta.write.block_ids.tolist() == s.block_table[1:3]
    assert meta.write.residual_src.numel() == 1 + 5  # seq 1's token 21, seq 2's five tokens
    assert cache.residual.dtype == model_dtype


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_attend_and_write_on_gpu_match_cpu(kv_dtype):
    gen = torch.Generator().manual_seed(13)
    cpu = make_cache(kv_dtype, 2, gen)
    gpu = KVCache(cpu.layout, NUM_BLOCKS, SLOTS, torch.float32, "cuda")
    gpu.pool.copy_(cpu.pool)
    gpu.residual.copy_(cpu.residual)
    seqs = make_slices(CASES["mixed"], gen)
    T = sum(s.num_new for s in seqs)
    q, k, v = (torch.randn(T, h, D, generator=gen) for h in (6, 2, 2))
    be = TorchBackend()
    outs = []
    for cache, dev in ((cpu, "cpu"), (gpu, "cuda")):
        meta = build_attention_metadata(seqs, cache.layout, SLOTS, dev)
        outs.append(be.attend(cache, 1, q.to(dev), k.to(dev), v.to(dev), meta, D ** -0.5).cpu())
        be.write(cache, 1, k.to(dev), v.to(dev), meta)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gpu.residual.cpu(), cpu.residual)
    if kv_dtype in ("fp32", "fp16", "bf16", "int8", "int4"):
        assert torch.equal(gpu.pool.cpu(), cpu.pool)
