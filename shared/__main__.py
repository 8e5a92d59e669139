"""`python -m kvmesh ...` is the `kvmesh` command (the launcher starts its children this way)."""
import sys

from kvmesh.cli import main

sys.exit(main())
