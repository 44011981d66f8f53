"""Run a command on leased GPUs and record NVML memory before/after (see eagle3lib.gpu)."""

import sys

import _bootstrap  # noqa: F401
from eagle3lib.gpu import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
