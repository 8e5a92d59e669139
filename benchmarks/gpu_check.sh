#!/usr/bin/env bash
# GPU check for the Triton kernels, run from the repository root on the H200:
#   bash benchmarks/gpu_check.sh [--quick] [--reps N]    logs go to $OUT (default ./gpu_check_out)
# Measured on the H200: tests ~3.5 min (mostly Triton compiles), benchmark ~1.5 min.
# 1. the GPU-marked kernel tests (correctness at real shapes, pools past 65,536 pages) and the
#    tiny-model greedy generation test (Triton vs torch backend),
# 2. benchmarks/kernels.py (decode per KV dtype vs SDPA, cache write, prefill/extend).
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
cd "$ROOT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.log"

echo "== GPU attention tests" | tee "$OUT/tests.log"
# only the GPU-marked ones: the others build CPU tensors for the interpreter, which conftest enables
timeout 300 $PY -m pytest --noconftest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_kernels_attention.py 2>&1 | tee -a "$OUT/tests.log"
echo "attention tests exit: $?" | tee -a "$OUT/tests.log"
echo "== cache write tests (all run on the GPU) + tiny-model greedy generation, Triton vs torch" \
  | tee -a "$OUT/tests.log"
timeout 180 $PY -m pytest --noconftest -p no:cacheprovider -q -o addopts="" \
  tests/test_kernels_cache_write.py tests/test_kernels_model.py 2>&1 | tee -a "$OUT/tests.log"
echo "write/model tests exit: $?" | tee -a "$OUT/tests.log"

echo "== benchmark" | tee "$OUT/bench.log"
# --sweep: also time 17 tile/warp/stage/register-cap variants of fp16 and fp8_e4m3 decode at 64x4096 (~1 min)
timeout 420 $PY benchmarks/kernels.py --out "$OUT/bench_table.md" --sweep --sweep-dtypes fp16,fp8_e4m3 "$@" \
  2>&1 | tee -a "$OUT/bench.log"
echo "benchmark exit: $?" | tee -a "$OUT/bench.log"
rm -rf "$SHIM"
