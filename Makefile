# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, builds the package (C++ core included) and runs the main job
#   make test   creates .venv, installs the test extras and runs the whole test suite
# Override TORCH_SPEC to bring another torch (e.g. TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu").
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,structured,plot
PYTEST_ARGS ?= -n 2 --timeout 900

.PHONY: demo test setup ext lint bench clean

$(VENV)/.ready: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0"
	$(PY) -m pip install -q --no-build-isolation -e ".[$(EXTRAS)]"
	touch $@

setup: $(VENV)/.ready

# Rebuild the C++ extension after csrc/ changes (incremental; seconds when nothing changed).
ext: $(VENV)/.ready
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

demo: ext
	$(PY) -m deepinfer_core

test: ext
	$(PY) -m pytest $(PYTEST_ARGS) tests

lint: setup
	$(PY) -m ruff check src tests benchmarks examples

bench: ext
	for b in benchmarks/*.py; do case $$b in */_*) ;; *) $(PY) $$b --quick || exit 1;; esac; done

clean:
	rm -rf build $(VENV)
