"""torch's torchrun for the train job's processes, with one line a failed rank instead of
torch's traceback (eagle3lib.multinode.run_torchrun); the train script execs it."""

import sys

import _bootstrap  # noqa: F401
from eagle3lib.multinode import run_torchrun

if __name__ == "__main__":
    sys.exit(run_torchrun(sys.argv[1:]))
