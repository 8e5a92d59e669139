"""python -m kvmesh.kvstore [flags]: the same as `kvmesh kvstore [flags]` (env defaults, tracing,
SIGINT/SIGTERM stop, also when SIGINT was inherited ignored)."""
import sys

from kvmesh.cli import main

if __name__ == "__main__":
    sys.exit(main(["kvstore", *sys.argv[1:]]))
