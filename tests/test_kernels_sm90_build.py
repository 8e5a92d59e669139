"""The register-direct decode kernels (Gluon) cannot run under Triton's interpreter, so CI builds them
for the H200's sm_90 instead, through Triton's own ptxas, and checks what the chunk loop is made of:
a version of Triton whose Gluon API moved (Triton 3.9 renamed `_reinterpret`, which turned the INT4
kernel off with a warning) or a change that spills fails here, not only on the GPU. The plain kernel's
bf16 launches are built too: the launcher's choice among them rests on how many programs an SM holds."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvmesh.kernels.sm90_build import CASES, H200_SHARED_PER_SM, SPILL_BUDGET
from kvmesh.kernels.splits import resident_programs


def _build(*args: str):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real build, not the interpreter
    done = subprocess.run([sys.executable, "-m", "kvmesh.kernels.sm90_build", *args], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def report() -> list[dict]:
    return _build()


def test_bf16_launches_hold_the_programs_the_launcher_counts_on():
    # two dots 209-213 registers (2 programs an SM), lo rows 167-168 (3), lo rows at 5 stages 140 KB of
    # shared memory (1): the residencies tests/test_decode_tiles.py takes for the H200
    assert _build("--bf16-launches") == {"two dots": 2, "lo rows": 3, "lo rows deep": 1}


def test_every_direct_kernel_builds_for_sm90(report):
    assert [(r["kernel"], r["head_dim"], r["group"]) for r in report] == [c[:3] for c in CASES]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_chunk_loop_in_registers_with_tensor_cores_and_wide_loads(report, i):
    r = report[i]
    assert 0 < r["registers"] <= (r["cap"] or 255), r
    assert r["stack"] <= SPILL_BUDGET.get(CASES[i][:3], 0), f"spills: {r}"
    # a 16-token chunk: 16 channels a k-step for the scores, 16 rows an m-tile for the values
    assert r["hmma"] >= 2 * r["head_dim"] // 16, r
    assert r["wide_loads"] >= 1, r  # pages come in 16-byte loads straight into fragments
    assert 100 < r["loop"] < 1000, r


def test_int4_ring_holds_16_programs_an_sm(report):
    # Llama heads: the cp.async ring (3 chunks, ~10.5 KB) and 128 registers keep 16 one-warp programs an
    # H200 SM, where the register loads (140 registers) held 12
    r = report[CASES.index(("int4", 128, 4, 128))]
    assert resident_programs(r["registers"], r["shared"], 1, H200_SHARED_PER_SM) == 16, r


def test_work_list_launches_keep_the_chunk_loop(report):
    # a ragged batch's launch reads its (sequence, split) from the work list before anything else: the
    # same registers' budget, no new spills, the loop's MMAs and wide loads, and its length within a
    # few instructions (ptxas schedules the same loop a little differently: INT4's 387 -> 386)
    work = _build("--work")
    for i, w in enumerate(work):
        r = report[i]
        assert (w["kernel"], w["head_dim"], w["group"]) == (r["kernel"], r["head_dim"], r["group"])
        assert 0 < w["registers"] <= (w["cap"] or 255) and w["stack"] <= r["stack"], (w, r)
        assert (w["hmma"], w["wide_loads"]) == (r["hmma"], r["wide_loads"]) and abs(w["loop"] - r["loop"]) <= 4, (w, r)
