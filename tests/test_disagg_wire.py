"""Worker flags and proto <-> engine conversions (no model, no network: fast)."""
from __future__ import annotations

import argparse
import math
import random

import pytest

from kvmesh.decode import config as decode_config
from kvmesh.engine.outputs import KVExport, TokenLogprob
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine_args import parse_bytes
from kvmesh.prefill import config as prefill_config
from kvmesh.wire import convert
from kvmesh.wire import kvmesh_pb2 as pb


def _parse(module, argv):
    p = argparse.ArgumentParser()
    module.add_cli_args(p)
    return module.from_args(p.parse_args(argv))


def test_worker_flags_build_engine_config():
    cfg = _parse(decode_config, ["--kvstore", "a:1,b:2", "--kvstore", "c:3", "--kv-cache-dtype", "fp8",
                                 "--block-size", "32", "--kv-cache-memory", "64M", "--no-enable-prefix-caching",
                                 "--index-url", "redis://localhost:6379", "--max-num-seqs", "7",
                                 "--port", "0", "--metrics-port", "0", "--no-engine-process",
                                 "--engine-shared-memory-mib", "1024"])
    assert cfg.kvstore == ("a:1", "b:2", "c:3")
    assert cfg.engine_process is False
    assert cfg.engine_shared_memory_mib == 1024
    assert cfg.engine.cache.kv_cache_dtype == "fp8"
    assert cfg.engine.cache.block_size == 32
    assert cfg.engine.cache.kv_cache_memory == 64 << 20
    assert cfg.engine.cache.enable_prefix_caching is False
    assert cfg.engine.scheduler.max_num_seqs == 7
    assert cfg.redis_url == "redis://localhost:6379"
    assert cfg.holder(4321) == "127.0.0.1:4321"
    pcfg = _parse(prefill_config, ["--kvstore", "k:9", "--host", "0.0.0.0", "--advertise-address", "pf:70"])
    assert pcfg.port == prefill_config.DEFAULT_PORT and pcfg.holder(1) == "pf:70"
    assert pcfg.engine.cache.enable_prefix_caching is True
    assert pcfg.engine_process is True  # the default: each worker's engine in a process of its own
    assert pcfg.engine_shared_memory_mib == 256
    with pytest.raises(ValueError, match="--engine-shared-memory-mib"):
        _parse(prefill_config, ["--kvstore", "k:9", "--engine-shared-memory-mib", "-1"])


def test_environment_defaults_and_command_line_override():
    from kvmesh.cli import build_parser

    env = {"KVMESH_KVSTORE": "a:1,b:2", "KVMESH_MAX_PENDING_REQUESTS": "5", "KVMESH_KV_CACHE_DTYPE": "int8",
           "KVMESH_ENABLE_PREFIX_CACHING": "false"}
    parser = build_parser("decode", env)
    cfg = decode_config.from_args(parser.parse_args(["decode"]))
    assert cfg.kvstore == ("a:1", "b:2") and cfg.max_pending_requests == 5
    assert cfg.engine.cache.kv_cache_dtype == "int8" and not cfg.engine.cache.enable_prefix_caching
    # A flag on the command line replaces the environment's list, it does not extend it.
    cfg = decode_config.from_args(parser.parse_args(["decode", "--kvstore", "c:3", "--kvstore", "d:4"]))
    assert cfg.kvstore == ("c:3", "d:4")


@pytest.mark.parametrize("argv, flag", [
    ([], "--kvstore"),
    (["--kvstore", "nohost"], "--kvstore"),
    (["--kvstore", "a:1", "--port", "70000"], "--port"),
    (["--kvstore", "a:1", "--block-size", "12"], "--block-size"),
    (["--kvstore", "a:1", "--lease-seconds", "0"], "--lease-seconds"),
    (["--kvstore", "a:1", "--advertise-address", "x"], "--advertise-address"),
    (["--kvstore", "a:1", "--max-pending-requests", "-1"], "--max-pending-requests"),
])
def test_bad_worker_flags_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        _parse(prefill_config, argv)


def test_parse_bytes():
    assert parse_bytes("1536") == 1536
    assert parse_bytes("512M") == 512 << 20
    assert parse_bytes("1.5GiB") == 3 << 29
    with pytest.raises(argparse.ArgumentTypeError, match="--kv-cache-memory"):
        parse_bytes("lots")


def test_sampling_params_round_trip():
    rng = random.Random()
    for _ in range(20):
        max_tokens = rng.choice([None, rng.randint(1, 500)])
        p = SamplingParams(
            temperature=rng.choice([0.0, 0.5, 1.25]), top_p=rng.choice([1.0, 0.5]), top_k=rng.choice([-1, 5]),
            min_p=rng.choice([0.0, 0.25]), seed=rng.choice([None, rng.randint(0, 2**40)]),
            max_tokens=max_tokens, min_tokens=rng.randint(0, max_tokens or 3),
            stop=rng.choice([None, ["\n", "END"]]), stop_token_ids=rng.choice([None, [2, 7]]),
            ignore_eos=rng.random() < 0.5, presence_penalty=rng.choice([0.0, 0.5]),
            frequency_penalty=rng.choice([0.0, -0.5]), repetition_penalty=rng.choice([1.0, 1.25]),
            logprobs=rng.choice([None, 0, 5]), prompt_logprobs=rng.choice([None, 0, 3]),
            include_stop_str_in_output=rng.random() < 0.5,
            logit_bias=rng.choice([None, {5: 2.5, 90: -100.0}]))
        wire = pb.SamplingParams.FromString(convert.sampling_to_proto(p).SerializeToString())
        assert convert.sampling_from_proto(wire) == p


def test_sampling_params_from_proto_validates():
    with pytest.raises(ValueError, match="temperature"):
        convert.sampling_from_proto(pb.SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="n must be 1"):
        convert.sampling_to_proto(SamplingParams(n=2))
    # Zero-valued proto fields that cannot be meant literally read as the defaults.
    p = convert.sampling_from_proto(pb.SamplingParams())
    assert (p.temperature, p.top_p, p.repetition_penalty, p.max_tokens, p.logprobs) == (0.0, 1.0, 1.0, None, None)


def test_logprobs_round_trip():
    rng = random.Random()
    lps = [TokenLogprob(rng.randrange(49152), -rng.random() * 10,
                        [(rng.randrange(49152), -rng.random()) for _ in range(rng.randint(0, 4))])
           for _ in range(6)]
    back = convert.logprobs_from_proto(convert.logprobs_to_proto(lps))
    assert [b.token_id for b in back] == [a.token_id for a in lps]
    for a, b in zip(lps, back):
        assert math.isclose(a.logprob, b.logprob, rel_tol=1e-6)  # float32 on the wire
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    prompt = [None] + lps
    got = convert.prompt_logprobs_from_proto(convert.prompt_logprobs_to_proto(prompt))
    assert got[0] is None and [g.token_id for g in got[1:]] == [a.token_id for a in lps]
    assert convert.prompt_logprobs_from_proto([]) is None
    with pytest.raises(ValueError, match=r"prompt_logprobs\[2\]"):
        convert.prompt_logprobs_to_proto([None, lps[0], None])


def test_blocks_tail_and_resume():
    rng = random.Random()
    refs = [convert.BlockRef(rng.randbytes(32), f"n{i}:1") for i in range(3)]
    assert convert.block_refs_from_proto(convert.block_refs_to_proto(refs)) == refs
    with pytest.raises(ValueError, match=r"cached_blocks\[0\].hash"):
        convert.block_refs_from_proto([pb.BlockRef(hash=b"short")])
    tail = rng.randbytes(512)
    export = KVExport.of(blocks=[], tail_tokens=5, tail=tail, tail_dtype="fp32")
    t = convert.tail_from_export(export)
    assert convert.tail_from_proto(convert.tail_to_proto(t)) == t
    reply = pb.PrefillReply(first_token=42, tail=convert.tail_to_proto(t),
                            first_logprob=pb.TokenLogprob(token_id=42, logprob=-0.5))
    r = convert.resume_from_prefill(reply, want_logprobs=True)
    assert (r.output_token_ids, r.tail_tokens, r.tail) == ([42], 5, tail)
    assert r.output_logprobs[0].token_id == 42
    assert convert.resume_from_prefill(reply, want_logprobs=False).output_logprobs is None


async def test_block_transfer_pull_and_push_against_a_real_store(tmp_path):
    """BlockTransfer between a real BlockStore (in-process transport) and a real engine on a tiny
    random model: pushes only what the store lacks, pulls the longest usable prefix, releases."""
    from kvmesh.block_transfer import BlockTransfer, layout_id
    from kvmesh.config import CacheConfig, EngineConfig
    from kvmesh.engine.async_engine import AsyncEngine
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.outputs import ExportedBlock
    from kvmesh.kvstore.client import LocalKVStoreClient
    from kvmesh.kvstore.config import KVStoreConfig
    from kvmesh.kvstore.store import BlockStore
    from test_engine_models import make_tiny_model

    make_tiny_model(tmp_path)
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", cache=CacheConfig(
        kv_cache_dtype="int8", kv_cache_memory=64 * 1024))))
    layout = engine.engine.layout
    rng = random.Random()
    store = BlockStore(KVStoreConfig(capacity_bytes=1 << 20))
    t = BlockTransfer(LocalKVStoreClient(store), layout, engine.engine.model_id, holder="w:1", lease_seconds=30.0)
    blocks = [ExportedBlock(rng.randbytes(32), [rng.randrange(256) for _ in range(layout.block_size)],
                            rng.randbytes(layout.block_bytes)) for _ in range(5)]
    # push: only what the store lacks, skipping `known` without asking.
    r = await t.push(blocks[:3], known={blocks[0].hash})
    assert (r.stored, r.nbytes) == (2, 2 * layout.block_bytes)
    assert store.contains([b.hash for b in blocks]) == [False, True, True, False, False]
    assert (await t.push(blocks[:3])).stored == 1  # block 0; 1 and 2 are already held
    # Block 3 was written under another layout (another model): not importable here.
    store.put(blocks[3].hash, blocks[3].data, blocks[3].token_ids, layout_id("other-model", layout))
    await engine.start()
    try:
        r = await t.pull(engine, [b.hash for b in blocks], local={blocks[1].hash})
        assert r.imported == [blocks[0].hash, blocks[2].hash] and r.missing == 2  # stops at block 3
        assert 0 < r.get_seconds and 0 < r.import_seconds and r.get_seconds + r.import_seconds <= r.seconds
        held = await engine.run(lambda e: [e.kv.contains(b.hash) for b in blocks])
        assert held == [True, False, True, False, False]
        assert not any(store.leases.is_leased(b.hash) for b in blocks)  # released after the import
        # Nothing to fetch: no store call.
        assert (await t.pull(engine, [blocks[1].hash], local={blocks[1].hash})).imported == []
    finally:
        await engine.stop()
