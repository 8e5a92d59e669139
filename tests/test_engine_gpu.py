"""The engine on a CUDA device: pool sized from --gpu-memory-utilization, greedy parity with
transformers through the torch and the Triton backends. Runs under pytest on a GPU machine, or as a
script (`python tests/test_engine_gpu.py`) where pytest is not installed."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_engine_models import hf_greedy, make_tiny_model, random_prompts  # noqa: E402

try:
    import pytest
    gpu = pytest.mark.gpu
except ImportError:  # script mode on a machine without pytest
    def gpu(f):
        return f


def _run(model: str, backend: str, kv_dtype: str, prompts, new: int | list[int], enforce_eager: bool = False,
         **cache) -> tuple[list, object]:
    """Greedy tokens of each prompt (`new` of them, or new[i] for prompt i) and the engine."""
    from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.sampling_params import SamplingParams
    eng = LLMEngine(EngineConfig(model=model, device="cuda", dtype="fp32", attention_backend=backend,
                                 enforce_eager=enforce_eager, cache=CacheConfig(kv_cache_dtype=kv_dtype, **cache),
                                 scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)))
    for i, p in enumerate(prompts):
        n = new if isinstance(new, int) else new[i]
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids
    eng.kv.check_integrity()
    return [final[f"r{i}"] for i in range(len(prompts))], eng


@gpu
def test_gpu_engine_greedy_parity_and_pool_sizing(tmp_path=None):
    tmp = Path(tmp_path or tempfile.mkdtemp())
    hf = make_tiny_model(tmp, "llama", seed=61)
    prompts = random_prompts(4, 5, 70, seed=1)
    ref = [hf_greedy(hf, p, 32) for p in prompts]
    got, eng = _run(str(tmp), "torch", "auto", prompts, 32, gpu_memory_utilization=0.3)
    assert got == ref
    free, total = torch.cuda.mem_get_info()
    pool = eng.runner.cache.pool
    assert pool.is_cuda and pool.numel() <= 0.3 * total and eng.kv.num_blocks > 1000
    del eng, pool
    torch.cuda.empty_cache()
    got, _ = _run(str(tmp), "triton", "auto", prompts, 32, kv_cache_memory=8 << 20)
    assert got == ref
    for kv in ("fp8", "int8"):  # quantized: the two backends must agree with each other
        a, _ = _run(str(tmp), "torch", kv, prompts, 32, kv_cache_memory=8 << 20)
        b, _ = _run(str(tmp), "triton", kv, prompts, 32, kv_cache_memory=8 << 20)
        same = sum(x == y for x, y in zip(a, b))
        print(f"{kv}: torch vs triton identical continuations {same}/{len(a)}")



@gpu
def test_gpu_async_scheduling_matches_synchronous_steps(tmp_path=None):
    """Decode and prompt steps through their CUDA graphs, each launched before the last one's tokens
    are read back: the same greedy and seeded tokens, penalties, logprobs, n = 2, stop tokens found a
    step late, as without."""
    from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.sampling_params import SamplingParams
    tmp = Path(tmp_path or tempfile.mkdtemp())
    make_tiny_model(tmp, "llama", seed=62)
    prompts = random_prompts(12, 5, 90, seed=2)

    def run(overlap: bool, stop_ids=None) -> tuple[dict, object]:
        eng = LLMEngine(EngineConfig(model=str(tmp), device="cuda", dtype="fp32", cache=CacheConfig(
            kv_cache_dtype="auto", kv_cache_memory=16 << 20), scheduler=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=256, async_scheduling=overlap)))
        for i, p in enumerate(prompts):
            sp = SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i, max_tokens=20 + 3 * i, ignore_eos=True,
                                stop_token_ids=None if stop_ids is None else [stop_ids[i]],
                                repetition_penalty=1.2 if i % 4 == 1 else 1.0,
                                frequency_penalty=0.5 if i % 4 == 2 else 0.0, logprobs=2 if i % 5 == 0 else None,
                                n=2 if i % 6 == 3 else 1)
            eng.add_request(f"r{i}", p, sp)
        final = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    lps = o.outputs[0].logprobs
                    final[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].finish_reason,
                                           None if lps is None else [round(t.logprob, 3) for t in lps],
                                           [c.token_ids for c in o.outputs[1:]])  # n = 2: the second
        eng.kv.check_integrity()
        assert eng.stats().kv_cache_usage == 0.0
        return final, eng

    want, _ = run(False)
    got, eng = run(True)
    assert got == want and eng.stats().async_steps > 20 and eng.runner.graphs.replays > 20
    stops = [want[f"r{i}"][0][6] for i in range(len(prompts))]
    want, _ = run(False, stops)
    got, _ = run(True, stops)
    assert got == want and sum(r == "stop" for _, r, _, _ in got.values()) >= len(prompts) // 2


if __name__ == "__main__":
    test_gpu_engine_greedy_parity_and_pool_sizing()
    test_gpu_async_scheduling_matches_synchronous_steps()
    print("GPU engine test passed")
