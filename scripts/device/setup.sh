#!/usr/bin/env bash
# There (the H200 host), first call: installs the carried wheels into /tmp/site and keeps the
# model's first part in /tmp for the second call (scripts/device/pack.sh says how they travel).
set -eu
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
if [ -f .mdl/part_aa ]; then cp .mdl/part_aa /tmp/part_aa; fi
source scripts/device/env.sh
python3 -c "import kvmesh.kvstore.client, kvmesh.gateway.app, openai, gguf" && echo "device setup: ok"
