"""python -m kvmesh.gateway [flags]: the same as `kvmesh gateway [flags]` (env defaults, tracing,
SIGINT/SIGTERM stop)."""
import sys

from kvmesh.cli import main

if __name__ == "__main__":
    sys.exit(main(["gateway", *sys.argv[1:]]))
