"""python -m kvmesh.prefill [flags]: the same as `kvmesh prefill [flags]`."""
import sys

from kvmesh.cli import main

sys.exit(main(["prefill", *sys.argv[1:]]))
