# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, builds the package (C++ core included, structured extra) and runs the main job
#   make test   creates .venv, installs the test extras and runs the whole test suite
# Override TORCH_SPEC to bring another torch (e.g. TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu").
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,structured,plot
PYTEST_ARGS ?= -n 2 --timeout 900

# `make demo` needs only the structured extra (the demo's grammar sections); the test and plot extras are
# installed by `make test` / `make setup`.
DEMO_EXTRAS ?= structured
EXT_BUILD = $(PY) -m pip install -q --no-build-isolation --no-deps -e .

.PHONY: demo test setup ext lint bench clean _venv

# One environment build, with the extras in SETUP_EXTRAS; not quiet, so a first run shows its progress
# (the torch download and the C++ compile take minutes).
_venv:
	@echo "== setting up $(VENV) with extras [$(SETUP_EXTRAS)] (first run: torch download + C++ build, a few minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --progress-bar on $(TORCH_SPEC)
	$(PY) -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0"
	@echo "== building deepinfer-components and its C++ core (cmake + your compiler)"
	$(PY) -m pip install --no-build-isolation -e ".[$(SETUP_EXTRAS)]"

$(VENV)/.ready: pyproject.toml
	@$(MAKE) --no-print-directory _venv SETUP_EXTRAS=$(EXTRAS)
	touch $@ $(VENV)/.ready-demo

# The full environment serves the demo too; otherwise install only what the demo needs.
$(VENV)/.ready-demo: pyproject.toml
	@if [ -f $(VENV)/.ready ] && [ ! pyproject.toml -nt $(VENV)/.ready ]; then touch $@; \
	else $(MAKE) --no-print-directory _venv SETUP_EXTRAS=$(DEMO_EXTRAS) && touch $@; fi

setup: $(VENV)/.ready

# Rebuild the C++ extension after csrc/ changes (incremental; seconds when nothing changed).
ext: $(VENV)/.ready
	$(EXT_BUILD)

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
