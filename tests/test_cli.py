"""`kvmesh` CLI: KVMESH_* environment defaults, errors naming the flag, the command lines `kvmesh up` builds."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from kvmesh.cli import build_parser, env_name, environ_for_engines, main
from kvmesh.launcher import Stack, StackConfig


def _parse(command: str, argv: list[str], environ: dict[str, str]):
    parser = build_parser(command, environ)
    args = parser.parse_args([command, *argv])
    return args, parser._subparsers._group_actions[0].choices[command]


def test_env_name():
    assert env_name("--kv-cache-dtype") == "KVMESH_KV_CACHE_DTYPE"
    assert env_name("--port") == "KVMESH_PORT"


def test_env_defaults_and_flag_wins():
    port = random.randint(1024, 65535)
    env = {"KVMESH_PORT": str(port), "KVMESH_CAPACITY_BYTES": "4096000", "KVMESH_HIGH_WATERMARK": "0.5",
           "KVMESH_LOW_WATERMARK": "0.25"}
    args, _ = _parse("kvstore", [], env)
    assert (args.port, args.capacity_bytes, args.high_watermark) == (port, 4096000, 0.5)
    args, _ = _parse("kvstore", ["--port", "7"], env)
    assert args.port == 7


def test_env_lists_bools_and_choices():
    env = {"KVMESH_DECODE": "127.0.0.1:1, 127.0.0.1:2", "KVMESH_PREFILL": "10.0.0.1:5",
           "KVMESH_KV_CACHE_DTYPE": "int8"}
    args, _ = _parse("gateway", [], env)
    assert args.decode == ["127.0.0.1:1", "127.0.0.1:2"] and args.prefill == ["10.0.0.1:5"]
    assert args.kv_cache_dtype == "int8"
    args, _ = _parse("up", [], {"KVMESH_ENABLE_PREFIX_CACHING": "false", "KVMESH_NUM_DECODE": "3"})
    assert args.enable_prefix_caching is False and args.num_decode == 3
    up = StackConfig.from_args(_parse("up", ["--no-fuse-norm-linears", "--async-scheduling"], {})[0])
    assert "--no-fuse-norm-linears" in up.engine_flags and "--async-scheduling" in up.engine_flags
    assert not any("fuse" in f for f in StackConfig.from_args(_parse("up", [], {})[0]).engine_flags)
    args, _ = _parse("prefill", [], {"KVMESH_ENABLE_PREFIX_CACHING": "no", "KVMESH_KVSTORE": "a:1,b:2"})
    assert args.enable_prefix_caching is False and args.kvstore == ["a:1", "b:2"]


@pytest.mark.parametrize("command,env,needle", [
    ("kvstore", {"KVMESH_PORT": "eighty"}, "KVMESH_PORT (--port): invalid value 'eighty'"),
    ("gateway", {"KVMESH_KV_CACHE_DTYPE": "fp4"}, "KVMESH_KV_CACHE_DTYPE (--kv-cache-dtype): invalid choice 'fp4'"),
    ("up", {"KVMESH_ENABLE_PREFIX_CACHING": "maybe"}, "KVMESH_ENABLE_PREFIX_CACHING (--enable-prefix-caching)"),
])
def test_bad_env_names_variable_and_flag(command, env, needle, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser(command, env)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["kvstore", "--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["kvstore", "--low-watermark", "0.99"], "--low-watermark"),
    (["gateway"], "--decode"),
    (["prefill", "--model", "smollm2"], "--kvstore"),
    (["decode", "--kvstore", "nohost"], "--kvstore expects host:port"),
    (["up", "--num-decode", "0"], "--num-decode must be >= 1, got 0"),
    (["up", "--redis-url", "http://x:1"], "--redis-url must start with redis://"),
    (["up", "--block-size", "12"], "--block-size"),
    (["up", "--kv-cache-dtype", "fp4"], "--kv-cache-dtype"),
    (["kvstore", "--port", "x"], "argument --port: invalid int value"),
    (["launch"], "invalid choice: 'launch'"),
    (["kvstore", "--loop-watch-seconds", "-1"], "--loop-watch-seconds must be >= 0, got -1.0"),
])
def test_errors_name_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv, environ={})
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_up_builds_command_lines_the_services_accept():
    cfg = StackConfig(model="smollm2", kv_cache_dtype="fp8", block_size=32, num_prefill=2, num_decode=1,
                      num_kvstore=2, api_key="k-" + str(random.getrandbits(32)), port=0,
                      engine_flags=("--max-num-seqs", "8", "--dtype", "fp32", "--no-enable-prefix-caching",
                                    "--no-async-scheduling", "--fuse-norm-linears"),
                      extra_args=(("decode", ("--lease-seconds", "7")),))
    stack = Stack(cfg)
    waves = stack._plan()
    roles = [[p.name for p in w] for w in waves]
    assert roles == [["index", "kvstore-0", "kvstore-1"], ["prefill-0", "prefill-1", "decode-0"], ["gateway"]]
    index, kv0, kv1 = waves[0]
    assert stack.index_url == index.health and index.health.startswith("http://127.0.0.1:")
    kv_addrs = sorted([kv0.health, kv1.health])
    import importlib
    configs = {}
    for proc in [p for w in waves for p in w if p.role != "index"]:
        assert proc.argv[1:3] == ["-m", "kvmesh"] and proc.argv[3] == proc.role
        args, _ = _parse(proc.role, proc.argv[4:], {})
        configs[proc.name] = importlib.import_module(f"kvmesh.{proc.role}.config").from_args(args)
    for name in ("prefill-0", "prefill-1", "decode-0"):
        w = configs[name]
        assert sorted(w.kvstore) == kv_addrs and w.redis_url == stack.index_url
        assert (w.engine.cache.kv_cache_dtype, w.engine.cache.block_size) == ("fp8", 32)
        assert w.engine.scheduler.max_num_seqs == 8 and w.engine.dtype == "fp32"
        assert w.engine.cache.enable_prefix_caching is False and w.engine.scheduler.async_scheduling is False
        assert w.engine.fuse_norm_linears is True  # opt-in, passed through
        assert f"{w.host}:{w.port}" == next(p.health for wv in waves for p in wv if p.name == name)
    assert configs["decode-0"].lease_seconds == 7 and configs["prefill-0"].lease_seconds != 7
    gw = configs["gateway"]
    assert list(gw.prefill) == [f"{c.host}:{c.port}" for c in (configs["prefill-0"], configs["prefill-1"])]
    assert list(gw.decode) == [f"{configs['decode-0'].host}:{configs['decode-0'].port}"]
    assert (gw.api_key, gw.kv_cache_dtype, gw.block_size, gw.dtype) == (cfg.api_key, "fp8", 32, "fp32")
    assert gw.redis_url == stack.index_url and gw.port == stack.gateway_port != 0
    assert configs["kvstore-0"].redis_url == stack.index_url


def test_up_with_metrics_gives_every_service_a_port_of_its_own():
    import argparse

    from kvmesh.launcher import add_up_args
    ap = argparse.ArgumentParser()
    add_up_args(ap)
    stack = Stack(StackConfig.from_args(ap.parse_args(["--metrics", "--num-decode", "2", "--port", "0"])))
    waves = stack._plan()
    ports = {}
    for proc in [p for w in waves for p in w if p.role not in ("index", "gateway")]:
        args, _ = _parse(proc.role, proc.argv[4:], {})
        ports[proc.name] = args.metrics_port
    assert set(ports) == {"kvstore-0", "prefill-0", "decode-0", "decode-1"}
    assert len(set(ports.values())) == 4 and all(ports.values())
    assert stack.metrics_urls == {**{n: f"http://127.0.0.1:{p}/metrics" for n, p in ports.items()},
                                  "gateway": f"http://127.0.0.1:{stack.gateway_port}/metrics"}
    plain = Stack(StackConfig(port=0))
    assert not any("--metrics-port" in p.argv for w in plain._plan() for p in w)  # off by default
    assert list(plain.metrics_urls) == ["gateway"]


def test_up_with_redis_has_no_index_process():
    stack = Stack(StackConfig(redis_url="redis://127.0.0.1:6390/0", num_prefill=0))
    waves = stack._plan()
    assert [p.name for p in waves[0]] == ["kvstore-0"] and [p.name for p in waves[1]] == ["decode-0"]
    for proc in [p for w in waves for p in w]:
        assert proc.argv[proc.argv.index("--redis-url") + 1] == "redis://127.0.0.1:6390/0"
    assert "--prefill" not in waves[2][0].argv


def test_engines_sleep_out_of_work_unless_told_otherwise():
    env: dict[str, str] = {}
    environ_for_engines(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    environ_for_engines(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}  # an operator's choice wins


def test_service_entry_loads_no_torch_before_the_engine_environment_is_set():
    """OpenMP reads OMP_WAIT_POLICY once, when torch loads: a torch import on the way to _run_service
    would make environ_for_engines too late."""
    code = ("import sys, uvloop, kvmesh.__main__, kvmesh.telemetry; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
