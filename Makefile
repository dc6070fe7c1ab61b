# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, builds the package (C++ core included, structured extra) and runs the main job
#   make test   creates .venv, installs the test extras and runs the whole test suite
# Override TORCH_SPEC to bring another torch (e.g. TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu").
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,structured,xgrammar,kvstore,plot
PYTEST_ARGS ?= -n 2 --timeout 900

# `make demo` needs only the light structured extra (llguidance + jsonschema: no GPU compiler, no
# transformers); the xgrammar, kvstore, plot and test extras are installed by `make test` / `make setup`.
DEMO_EXTRAS ?= structured
EXT_BUILD = $(PY) -m pip install -q --no-build-isolation --no-deps -e .
# The first build, verbose so that ninja's per-file progress lines can be shown (pip hides a build
# backend's output otherwise); the rest of pip's output goes to $(VENV)/cxx-build.log.
CXX_BUILD = $(PY) -m pip install -v --no-build-isolation --no-deps -e .
CXX_PROGRESS = awk '/^ *\[[0-9]+\/[0-9]+\] /{sub(/^ */, "   "); print; fflush()}'

.PHONY: demo test setup ext stubs lint bench clean _venv

# One environment build, with the extras in SETUP_EXTRAS; not quiet, so a first run shows its progress
# (the torch download and the C++ compile take minutes).
_venv:
	@echo "== setting up $(VENV) with extras [$(SETUP_EXTRAS)] (first run: torch download + C++ build, a few minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --progress-bar on $(TORCH_SPEC)
	$(PY) -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0"
	@echo "== compiling the C++ core deepinfer_core._C: 30-80 s on 2 cores, with the load (one line per file, [done/total])"
	@set -o pipefail; $(CXX_BUILD) 2>&1 | tee $(VENV)/cxx-build.log | $(CXX_PROGRESS) \
	  || { tail -n 40 $(VENV)/cxx-build.log; echo "== the C++ build failed; full log: $(VENV)/cxx-build.log"; exit 1; }
	@echo "== installing the package's dependencies and extras [$(SETUP_EXTRAS)]"
	$(PY) -m pip install --no-build-isolation -e ".[$(SETUP_EXTRAS)]"

$(VENV)/.ready: pyproject.toml
	@$(MAKE) --no-print-directory _venv SETUP_EXTRAS=$(EXTRAS)
	touch $@ $(VENV)/.ready-demo

# The full environment serves the demo too; otherwise install only what the demo needs.
$(VENV)/.ready-demo: pyproject.toml
	@if [ -f $(VENV)/.ready ] && [ ! pyproject.toml -nt $(VENV)/.ready ]; then touch $@; \
	else $(MAKE) --no-print-directory _venv SETUP_EXTRAS=$(DEMO_EXTRAS) && touch $@; fi

setup: $(VENV)/.ready

# Rebuild the C++ extension after csrc/ changes (incremental; seconds when nothing changed), then its
# type stubs (src/deepinfer_core/_C/*.pyi, nanobind's stubgen; committed and shipped in the wheel).
ext: $(VENV)/.ready
	$(EXT_BUILD)
	$(PY) scripts/gen_stubs.py

stubs: $(VENV)/.ready
	$(PY) scripts/gen_stubs.py

demo: $(VENV)/.ready-demo
	@echo "== rebuilding the C++ core if csrc/ changed"
	$(EXT_BUILD)
	$(PY) -m deepinfer_core

test: ext
	$(PY) -m pytest $(PYTEST_ARGS) tests

# The pre-commit checks (.pre-commit-config.yaml) that CI runs before the tests (.ci/run); clang-format
# (csrc/) is pre-commit only.
lint: setup
	$(PY) -m ruff check src tests benchmarks examples scripts
	$(PY) -m ruff format --check src tests benchmarks examples scripts
	$(PY) -m mypy src

bench: ext
	for b in benchmarks/*.py; do case $$b in */_*) ;; *) $(PY) $$b --quick || exit 1;; esac; done

clean:
	rm -rf build $(VENV)
