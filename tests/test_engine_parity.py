"""64-token greedy continuations identical to transformers' own forward pass, through the
single-request path (one request alone) and the batched path (continuous batching, chunked prefill,
mixed prefill + decode steps): tiny random models built in code and SmolLM2 from its GGUF."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from test_engine_models import hf_greedy, make_tiny_model, random_prompts, run_to_completion

torch.set_num_threads(1)  # 2 shared cores: more threads only add contention

NEW = 64


def run_all(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    final = run_to_completion(eng)  # also checks the allocator's integrity
    assert eng.kv.usage == 0.0
    return [final[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


def engine(model: str, **sched) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cpu", cache=CacheConfig(kv_cache_memory=8 << 20),
                                  scheduler=SchedulerConfig(**sched)))


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_model_greedy_matches_transformers(tmp_path, kind):
    hf = make_tiny_model(tmp_path, kind, seed=11)
    prompts = random_prompts(5, 3, 70, seed=len(kind))
    ref = [hf_greedy(hf, p, NEW) for p in prompts]
    # single-request path: each request alone in the engine
    single = engine(str(tmp_path), max_num_seqs=1)
    assert [run_all(single, [p], GREEDY)[0] for p in prompts] == ref
    # batched path: all at once, prompts split into chunks by a small token budget
    batched = engine(str(tmp_path), max_num_seqs=8, max_num_batched_tokens=32)
    assert run_all(batched, prompts, GREEDY) == ref


@pytest.fixture(scope="module")
def smollm2():
    from kvmesh.model.loader import model_cache_dir
    eng = engine("smollm2", max_num_seqs=4, max_num_batched_tokens=64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_cache_dir("smollm2"),
                                                           torch_dtype=torch.float32).eval()
    return eng, hf


def test_smollm2_greedy_matches_transformers(smollm2):
    eng, hf = smollm2
    tok = eng.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number"
             " using an iterative loop over the sequence of numbers.\"\"\"\n"]
    prompts = [tok.encode(t) for t in texts]
    ref = [hf_greedy(hf, p, NEW) for p in prompts]
    assert run_all(eng, prompts[:1], GREEDY) == ref[:1]  # alone
    assert run_all(eng, prompts, GREEDY) == ref  # batched, the longer prompt chunked
