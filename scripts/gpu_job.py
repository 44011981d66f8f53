"""Run a command on leased GPUs and record NVML memory before/after (see eagle3lib.gpu)."""

import sys

import _bootstrap  # noqa: F401
from eagle3lib.gpu import main
from eagle3lib.lifetime import die_with_parent, parent_gone

if __name__ == "__main__":
    if not die_with_parent():  # SIGTERM when snakemake dies; the wrapper then stops the job
        print(f"error: {parent_gone()}", file=sys.stderr, flush=True)
        sys.exit(128 + 15)
    sys.exit(main(["run", *sys.argv[1:]]))
