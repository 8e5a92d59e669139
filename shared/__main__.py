"""`python -m kvmesh ...` is the `kvmesh` command (the launcher starts its children this way)."""
import sys

from kvmesh.cli import main

if __name__ == "__main__":  # not when a spawned child (a worker's engine process) imports it
    sys.exit(main())
