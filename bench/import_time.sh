#!/usr/bin/env bash
# What a fresh job process pays to import torch and transformers (and the Llama model class)
# on this machine: three runs each, then with PYTHONPYCACHEPREFIX (bytecode elsewhere), then
# python -X importtime's largest cumulative entries. Run on the GPU machine with its image
# python3 (BENCHMARKS.md, "Importing torch and transformers"):  bash bench/import_time.sh
set -x
env | grep -i -E "PYTHON|pycache"
python3 -c "import sys; print(sys.version, sys.flags.dont_write_bytecode, sys.pycache_prefix)"
python3 -c "import torch, transformers; print(torch.__file__, transformers.__file__)"
T=$(python3 -c "import transformers, os; print(os.path.dirname(transformers.__file__))" 2>/dev/null)
ls -ld $T $T/__pycache__ $T/models/llama/__pycache__ 2>&1 | head
ls $T/__pycache__ 2>/dev/null | head -3
touch $T/.w && echo writable && rm $T/.w
mount | grep -E " / | /usr" | head -3
for i in 1 2 3; do /usr/bin/time -f "torch %e s" python3 -c "import torch"; done
for i in 1 2 3; do /usr/bin/time -f "transformers+llama %e s" python3 -c "import torch, transformers; from transformers import LlamaForCausalLM"; done
for i in 1 2; do PYTHONPYCACHEPREFIX=/tmp/pyc /usr/bin/time -f "prefix: transformers+llama %e s" python3 -c "import torch, transformers; from transformers import LlamaForCausalLM"; done
python3 -X importtime -c "import torch, transformers; from transformers import LlamaForCausalLM" 2>&1 | sort -t'|' -k2 -n | tail -12
nproc
lscpu | grep -E "Model name|MHz"
