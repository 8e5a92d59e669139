"""The offline API, as vLLM users know it:

    from kvmesh import LLM, SamplingParams
    llm = LLM(model="smollm2", kv_cache_dtype="fp8")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.outputs import OutputKind, RequestOutput
from kvmesh.engine.sampling_params import SamplingParams

Prompts = Union[str, Sequence[str], Sequence[Sequence[int]]]
Params = Union[SamplingParams, Sequence[SamplingParams], None]


class LLM:
    def __init__(self, model: str = "smollm2", *, dtype: str = "auto", device: str = "auto",
                 kv_cache_dtype: str = "auto", block_size: int = 16, enable_prefix_caching: bool = True,
                 gpu_memory_utilization: float = 0.9, kv_cache_memory: Optional[int] = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: Optional[int] = None, seed: int = 0,
                 attention_backend: str = "auto", tensor_parallel_size: int = 1, enforce_eager: bool = False,
                 max_seq_len_to_capture: int = 8192, fuse_norm_linears: bool = False) -> None:
        cfg = EngineConfig(
            model=model, dtype=dtype, device=device, seed=seed, attention_backend=attention_backend,
            enforce_eager=enforce_eager, max_seq_len_to_capture=max_seq_len_to_capture,
            fuse_norm_linears=fuse_norm_linears,
            tensor_parallel_size=tensor_parallel_size,
            cache=CacheConfig(block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                              enable_prefix_caching=enable_prefix_caching,
                              gpu_memory_utilization=gpu_memory_utilization,
                              kv_cache_memory=kv_cache_memory),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len))
        self.llm_engine = LLMEngine(cfg)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompts, params: Params = None, *, sampling_params: Params = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings (tokenized with the model's
        special tokens), lists of token ids, or vLLM-style dicts {"prompt": ...} /
        {"prompt_token_ids": [...]}. `sampling_params=` is accepted as vLLM spells it."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self._ids_of(p) for p in prompts], sampling_params if params is None else params)

    def _ids_of(self, p) -> list[int]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return list(p["prompt_token_ids"])
            if "prompt" in p:
                return self.llm_engine.tokenizer.encode(p["prompt"])
            raise ValueError("prompts: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        return self.llm_engine.tokenizer.encode(p) if isinstance(p, str) else list(p)

    def chat(self, messages: Union[list[dict], list[list[dict]]], params: Params = None, *,
             sampling_params: Params = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Applies the model's chat template (with the generation prompt) to each conversation."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.llm_engine.tokenizer
        ids = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
               for c in convs]
        return self._run(ids, sampling_params if params is None else params)

    def _run(self, ids: list[list[int]], params: Params) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(ids)
        if len(plist) != len(ids):
            raise ValueError(f"params: got {len(plist)} SamplingParams for {len(ids)} prompts")
        eng = self.llm_engine
        rids = [f"llm-{next(self._ids)}" for _ in ids]
        added: list[str] = []
        try:
            for rid, p, sp in zip(rids, ids, plist):
                eng.add_request(rid, p, sp, output_kind=OutputKind.FINAL_ONLY)
                added.append(rid)
            final: dict[str, RequestOutput] = {}
            while eng.has_unfinished():
                for out in eng.step():
                    if out.finished:
                        final[out.request_id] = out
        finally:
            for rid in added:
                eng.abort(rid)  # no-op for finished ones; frees the rest on error/interrupt
        return [final[r] for r in rids]
