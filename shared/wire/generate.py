"""Regenerates the gRPC code from kvmesh.proto (needs grpcio-tools): python -m kvmesh.wire.generate"""
from __future__ import annotations

import pathlib
import re

from grpc_tools import protoc


def main() -> None:
    here = pathlib.Path(__file__).resolve().parent
    rc = protoc.main(["protoc", f"-I{here}", f"--python_out={here}", f"--grpc_python_out={here}",
                      f"--pyi_out={here}", str(here / "kvmesh.proto")])
    if rc:
        raise SystemExit(rc)
    # protoc writes a top-level import; make it package-relative.
    grpc_file = here / "kvmesh_pb2_grpc.py"
    text = grpc_file.read_text()
    grpc_file.write_text(re.sub(r"^import kvmesh_pb2 as", "from kvmesh.wire import kvmesh_pb2 as", text, flags=re.M))


if __name__ == "__main__":
    main()
