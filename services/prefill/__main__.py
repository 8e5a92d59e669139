"""python -m kvmesh.prefill [flags]: the same as `kvmesh prefill [flags]`."""
import sys

from kvmesh.cli import main

if __name__ == "__main__":
    sys.exit(main(["prefill", *sys.argv[1:]]))
