"""The offline API as vLLM users write it: `from kvmesh import LLM, SamplingParams`."""
from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams
from test_engine_models import make_tiny_model

torch.set_num_threads(1)  # 2 shared cores: more threads only add contention


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model(d, "qwen2", seed=51)
    return LLM(model=str(d), kv_cache_memory=2 << 20, max_num_seqs=8)


def test_generate_strings_and_token_ids_in_order(llm):
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    texts = ["hello world", "a much longer prompt than the first one, to vary lengths", "x"]
    outs = llm.generate(texts, sp)
    assert [o.prompt_token_ids for o in outs] == [tok.encode(t) for t in texts]
    assert all(o.finished and len(o.outputs[0].token_ids) == 10 for o in outs)
    assert all(o.outputs[0].text == tok.decode(o.outputs[0].token_ids) for o in outs)
    one = llm.generate(texts[1], sp)
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    ids = llm.generate([tok.encode(texts[2])], sp)
    assert ids[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert llm.generate(texts[:2], [sp, SamplingParams(temperature=0.0, max_tokens=3)])[1].outputs[0].token_ids \
        == outs[1].outputs[0].token_ids[:3]
    dicts = llm.generate([{"prompt": texts[0]}, {"prompt_token_ids": tok.encode(texts[2])}], sampling_params=sp)
    assert [d.outputs[0].token_ids for d in dicts] == [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids]


def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert out.prompt_token_ids == tok.encode("<user>hi\n<assistant>", add_special_tokens=False)
    two = llm.chat([msgs, msgs], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_bad_params_raise_before_anything_runs(llm):
    with pytest.raises(ValueError, match="^top_k"):
        llm.generate(["a", "b"], SamplingParams(top_k=-5))
    with pytest.raises(ValueError, match="params: got 1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()])
    assert not llm.llm_engine.has_unfinished()
    assert llm.generate("ok", SamplingParams(max_tokens=2))[0].finished


def test_smollm2_chat():
    llm = LLM(kv_cache_memory=64 << 20, max_num_seqs=2)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert "Paris" in out.outputs[0].text
