"""python -m kvmesh.decode [flags]: the same as `kvmesh decode [flags]`."""
import sys

from kvmesh.cli import main

sys.exit(main(["decode", *sys.argv[1:]]))
