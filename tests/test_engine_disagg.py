"""Disaggregation hooks: prefill-only in engine A (max_tokens=1, export_kv), import + resume in
engine B; greedy output identical to one engine doing it all, for unquantized, fp8 and int4 KV. Also the
recompute fallback when an imported block is missing, and KV events."""
from __future__ import annotations

import pytest
import torch

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.outputs import ResumeState
from kvmesh.engine.sampling_params import SamplingParams
from test_engine_models import run_to_completion, make_tiny_model, random_prompts

torch.set_num_threads(1)  # 2 shared cores: more threads only add contention
NEW = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model(d, "llama", seed=31)
    return str(d)


def make(model: str, kv_dtype: str, overlap: bool = False, device: str = "cpu") -> LLMEngine:
    """overlap: async scheduling (`engine/inflight.py`), as on a GPU."""
    return LLMEngine(EngineConfig(model=model, device=device,
                                  cache=CacheConfig(kv_cache_memory=2 << 20, kv_cache_dtype=kv_dtype),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=32, async_scheduling=overlap)))


def finish(eng: LLMEngine) -> dict:
    return run_to_completion(eng)


def prefill(eng: LLMEngine, prompt: list[int], logprobs=None):
    eng.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=logprobs),
                    export_kv=True, hand_off=True)
    return finish(eng)["p"]


@pytest.mark.parametrize("kv_dtype,overlap", [("auto", False), ("fp8", False), ("auto", True)])
def test_prefill_export_import_resume_equals_one_engine(model_dir, kv_dtype, overlap):
    _hop_equals_one_engine(model_dir, kv_dtype, overlap, "cpu")


def test_int4_hop_equals_one_engine(tmp_path, monkeypatch):
    """INT4 pages (keys centered, symmetric; 32-channel value groups: head_dim 32) cross the hop byte
    for byte: both engines compute the same key centers."""
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    make_tiny_model(tmp_path / "tiny32", "llama", seed=31, head_dim=32)
    _hop_equals_one_engine(str(tmp_path / "tiny32"), "int4", False, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_gpu_prefill_export_import_resume_equals_one_engine(model_dir, kv_dtype):
    """On a GPU the export and the import are stream-ordered copies that nothing waits for, with
    steps launched ahead (async scheduling, CUDA graphs)."""
    _hop_equals_one_engine(model_dir, kv_dtype, True, "cuda")


def _hop_equals_one_engine(model_dir: str, kv_dtype: str, overlap: bool, device: str) -> None:
    prompt = random_prompts(1, 53, 53, seed=1)[0]  # 3 full blocks + 5 tail tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    one = make(model_dir, kv_dtype, device=device)
    one.add_request("x", prompt, greedy)
    ref = finish(one)["x"].outputs[0]

    a = make(model_dir, kv_dtype, overlap, device)
    pre = prefill(a, prompt, logprobs=1)
    exp = pre.kv_export
    assert exp is not None and len(exp.blocks) == 3 and exp.tail_tokens == 5
    assert all(len(b.data) == a.layout.block_bytes and len(b.token_ids) == 16 for b in exp.blocks)
    assert [b.token_ids for b in exp.blocks] == [prompt[i:i + 16] for i in (0, 16, 32)]
    stored = [h for ev, h in a.drain_kv_events() if ev == "stored"]
    assert stored == [b.hash for b in exp.blocks]
    first = pre.outputs[0].token_ids
    assert first == ref.token_ids[:1]

    b = make(model_dir, kv_dtype, overlap, device)
    assert b.import_blocks(exp.blocks) == 3
    assert b.import_blocks(exp.blocks) == 0  # already cached
    b.add_request("x", prompt, greedy, resume=ResumeState(first, exp.tail_tokens, exp.tail,
                                                          pre.outputs[0].logprobs))
    out = finish(b)["x"]
    assert out.num_cached_tokens == len(prompt)
    assert b.stats().computed_tokens == NEW - 1  # nothing of the prompt was recomputed
    assert out.outputs[0].token_ids == ref.token_ids
    assert out.outputs[0].text == ref.text
    assert [lp.token_id for lp in out.outputs[0].logprobs] == ref.token_ids


def test_missing_block_falls_back_to_recompute(model_dir):
    prompt = random_prompts(1, 40, 40, seed=2)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    one = make(model_dir, "auto")
    one.add_request("x", prompt, greedy)
    ref = finish(one)["x"].outputs[0].token_ids
    pre = prefill(make(model_dir, "auto"), prompt)
    b = make(model_dir, "auto")
    assert b.import_blocks(pre.kv_export.blocks[:1]) == 1  # the second block never arrives
    b.add_request("x", prompt, greedy, resume=ResumeState(pre.outputs[0].token_ids, pre.kv_export.tail_tokens,
                                                          pre.kv_export.tail))
    out = finish(b)["x"]
    assert out.outputs[0].token_ids == ref
    # recomputed from the first missing block: prompt rest + the given first token, then NEW - 2 decodes
    assert b.stats().computed_tokens == (40 + 1 - 16) + NEW - 2


def test_an_import_from_host_rows_writes_the_same_pages(model_dir):
    """`import_blocks(rows=...)` (the engine process's copy straight out of its imports segment)
    writes the pages the bytes path writes, skipping blocks already cached, and checks the rows."""
    prompt = random_prompts(1, 52, 52, seed=4)[0]
    exp = prefill(make(model_dir, "int8"), prompt).kv_export
    rows = torch.frombuffer(bytearray(b"".join(bytes(x.data) for x in exp.blocks)), dtype=torch.uint8)
    rows = rows.view(len(exp.blocks), -1)  # [3, block_bytes]
    by_bytes, by_rows = make(model_dir, "int8"), make(model_dir, "int8")
    assert by_bytes.import_blocks(exp.blocks) == 3
    assert by_rows.import_blocks(exp.blocks[1:2], rows=rows[1:2]) == 1
    assert by_rows.import_blocks(exp.blocks, rows=rows) == 2  # the middle one is cached: rows 0 and 2
    with pytest.raises(ValueError, match="rows holds 2 pages for 3 blocks"):
        by_rows.import_blocks(exp.blocks, rows=rows[:2])
    with pytest.raises(ValueError, match="rows must be uint8"):
        by_rows.runner.cache.write_rows([0], rows[:, :-1], [0])

    def pages(engine):
        ids = [engine.kv.pool.get_cached_block(x.hash).block_id for x in exp.blocks]
        return [engine.runner.cache.pool[i].tolist() for i in ids]
    assert pages(by_rows) == pages(by_bytes) == [list(bytes(x.data)) for x in exp.blocks]


def test_resume_validates_its_state(model_dir):
    b = make(model_dir, "auto")
    prompt = random_prompts(1, 20, 20, seed=3)[0]
    with pytest.raises(ValueError, match="resume.tail_tokens"):
        b.add_request("x", prompt, SamplingParams(), resume=ResumeState([1], 3, b""))
    with pytest.raises(ValueError, match="resume.output_token_ids"):
        b.add_request("x", prompt, SamplingParams(), resume=ResumeState([], 4, b""))
    with pytest.raises(ValueError, match="blocks\\[\\].data"):
        from kvmesh.engine.outputs import ExportedBlock
        b.import_blocks([ExportedBlock(b"h" * 32, prompt[:16], b"short")])


def test_seeded_sample_through_a_prefill_hop_equals_one_engine(model_dir):
    """The prefill engine draws the first token; the resumed sequence must draw the rest as one
    engine would (no re-seeded generator repeating the first draw)."""
    prompt = random_prompts(1, 37, 37, seed=11)[0]
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=NEW, ignore_eos=True)
    one = make(model_dir, "auto")
    one.add_request("x", prompt, seeded)
    ref = finish(one)["x"].outputs[0].token_ids

    a = make(model_dir, "auto")
    a.add_request("p", prompt, SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=1,
                                              ignore_eos=True), export_kv=True, hand_off=True)
    pre = finish(a)["p"]
    first, exp = pre.outputs[0].token_ids, pre.kv_export
    assert first == ref[:1]
    b = make(model_dir, "auto")
    b.import_blocks(exp.blocks)
    b.add_request("x", prompt, seeded, resume=ResumeState(first, exp.tail_tokens, exp.tail, None))
    got = finish(b)["x"].outputs[0].token_ids
    assert got == ref
    assert len(set(ref)) > 3  # really sampled, not a degenerate repeat
