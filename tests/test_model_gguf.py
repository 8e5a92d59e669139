"""SmolLM2 from the bundled Q4_1 GGUF: logits parity with transformers loading the same file, the
conversion cache, and our lazy GGUF reader against the `gguf` package's own reader."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache
from kvmesh.model.config import model_identity, resolve_model_path
from kvmesh.model.gguf_file import GGUFFile
from kvmesh.model.loader import model_cache_dir, load_model
from kvmesh.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("KVMESH_CACHE_DIR", str(tmp_path_factory.mktemp("kvmesh_cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def smollm(cache_env):
    torch.set_num_threads(1)
    return load_model("smollm2", torch.float32, "cpu")


def _prompt_ids() -> list[int]:
    tok = Tokenizer.from_model("smollm2")
    text = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}])
    return tok.encode(text, add_special_tokens=False)


def test_smollm2_logits_match_transformers_gguf(smollm):
    from transformers import AutoModelForCausalLM
    model, cfg = smollm
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) \
        == (30, 576, 9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and model.lm_head is None
    ids = _prompt_ids()
    layout = BlockLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, "fp32")
    cache = KVCache(layout, 8, 2, torch.float32)
    nb = -(-len(ids) // 16)
    meta = build_attention_metadata([SeqSlice(0, len(ids), list(range(nb)), 0)], layout, 2, "cpu")
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), meta, cache, TorchBackend())
    logits = model.compute_logits(hidden)  # [T, V]

    path = resolve_model_path("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert logits.shape == ref.shape == (len(ids), 49152)
    err = (logits - ref).abs().max().item()
    print(f"SmolLM2 GGUF, {len(ids)} tokens: max |dlogit| vs transformers {err:.2e}")
    assert err <= 1e-3
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def test_second_load_reads_the_cache(smollm, monkeypatch):
    model, cfg = smollm
    cache_dir = model_cache_dir("smollm2")
    assert cache_dir.name == model_identity("smollm2")
    for f in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert (cache_dir / f).is_file(), f

    def no_dequantize(self, name):
        raise AssertionError("second load dequantized the GGUF instead of reading the cache")

    monkeypatch.setattr(GGUFFile, "dequantize", no_dequantize)
    again, cfg2 = load_model("smollm2", torch.float32, "cpu")
    assert cfg2 == cfg
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    # the cached tokenizer files read back as the same tokenizer
    cached = Tokenizer.from_hf_dir(cache_dir)
    direct = Tokenizer.from_model("smollm2")
    text = "Bonjour ça va? 42 <|im_end|>"
    assert cached.encode(text) == direct.encode(text)
    assert cached.chat_template == direct.chat_template and cached.eos_token_ids == direct.eos_token_ids


def test_gguf_reader_matches_gguf_package():
    path = resolve_model_path("smollm2")
    ours = GGUFFile(path)
    ref = gguf.GGUFReader(path)
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.offset == t.data_offset and info.qtype == t.tensor_type, t.name
        assert info.nbytes == t.n_bytes and np.array_equal(ours.raw(t.name).reshape(-1), t.data.reshape(-1).view(np.uint8))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        got = ours.metadata[key]
        want = field.contents()
        if isinstance(got, np.ndarray):
            assert got.tolist() == list(want), key
        elif isinstance(got, float):
            assert got == pytest.approx(want, rel=1e-7), key
        else:
            assert got == want, key
    # one quantized tensor of each type dequantizes as gguf does it
    for name in ("token_embd.weight", "blk.3.attn_k.weight", "blk.3.ffn_norm.weight"):
        t = next(x for x in ref.tensors if x.name == name)
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ours.tensors[name].shape)
        assert np.array_equal(ours.dequantize(name), want), name
