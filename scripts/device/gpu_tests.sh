#!/usr/bin/env bash
# There (the H200 host), after `source scripts/device/env.sh` (the second call): every GPU-marked
# test, in six groups side by side (~320 s together on one H200, where one after another would not
# fit a call's 600 s), each group's log under $OUT and a summary of the failures.
#   bash scripts/device/gpu_tests.sh [seconds a group may take, default 420]
set -u
cd "$(dirname "$0")/../.."
T=${1:-420}
PYTEST="python3 -m pytest --noconftest -p no:cacheprovider -q -o addopts= -rf -m gpu"
date -u
timeout "$T" $PYTEST tests/test_kernels_int4.py > "$OUT/t_int4.log" 2>&1 &
timeout "$T" $PYTEST tests/test_kernels_attention.py -k direct > "$OUT/t_direct.log" 2>&1 &
timeout "$T" $PYTEST tests/test_kernels_attention.py -k "not direct" > "$OUT/t_attention.log" 2>&1 &
timeout "$T" $PYTEST tests/test_kernels_cache_write.py tests/test_kernels_model.py tests/test_kernels_prefix_stage.py \
  tests/test_kv_attention.py tests/test_kv_quant.py tests/test_kernels_gated_silu.py tests/test_kernels_rope.py \
  tests/test_kernels_norm_linear.py tests/test_tile_order.py tests/test_work_list.py > "$OUT/t_small.log" 2>&1 &
timeout "$T" $PYTEST tests/test_kvstore_gpu.py tests/test_kvstore_get_many.py tests/test_host_copies.py \
  tests/test_engine_process.py tests/test_engine_disagg.py > "$OUT/t_transfer.log" 2>&1 &
timeout "$T" $PYTEST tests/test_decode_graphs.py tests/test_chunk_graphs.py tests/test_engine_gpu.py \
  tests/test_model_gpu.py tests/test_smollm2_gpu.py > "$OUT/t_engine.log" 2>&1 &
wait
date -u
for f in "$OUT"/t_*.log; do
  echo "$(basename "$f"): $(tail -1 "$f")"
  grep -E '^(FAILED|ERROR)' "$f" | head -5
done
