"""Make the repository's eagle3lib importable from any environment that runs a script."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Before anything slow: the parent this process started with, to tell later whether it died
# before the process asked to die with it (eagle3lib/lifetime.py, PARENT_AT_START).
import eagle3lib.lifetime  # noqa: E402, F401
