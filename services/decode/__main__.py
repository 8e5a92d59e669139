"""python -m kvmesh.decode [flags]: the same as `kvmesh decode [flags]`."""
import sys

from kvmesh.cli import main

if __name__ == "__main__":
    sys.exit(main(["decode", *sys.argv[1:]]))
