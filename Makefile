# `make run` and `make test` do all their set-up themselves on a fresh machine.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# A Python >= 3.12: $(PYTHON) if given, else python3.12/python3.13 on PATH, else pyenv's 3.12.
PYTHON ?= $(shell for c in python3.12 python3.13 python3; do \
	  p=$$(PYENV_VERSION=3.12.1 command -v $$c 2>/dev/null) || continue; \
	  PYENV_VERSION=3.12.1 $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo "PYENV_VERSION=3.12.1 $$p"; break; }; \
	done; \
	for d in $$HOME/.pyenv/versions/3.12*/bin/python3.12; do [ -x $$d ] && { echo $$d; break; }; done | head -1)

.PHONY: run test fixtures lint format venv gpu-test clean

$(VENV)/.stamp: pyproject.toml constraints.txt
	@if [ -z "$(PYTHON)" ]; then echo "error: swajax needs Python >= 3.12 (none found on PATH or in pyenv); set PYTHON=/path/to/python3.12" >&2; exit 1; fi
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	@touch $@

venv: $(VENV)/.stamp

run: $(VENV)/.stamp
	$(PY) -m swajax.main

test: $(VENV)/.stamp
	$(PY) -m ruff check swajax pallas_kernels gemma experiments tests
	$(PY) -m ruff format --check swajax pallas_kernels gemma experiments tests
	$(PY) -m pytest -m "not gpu" -n 2 -q

gpu-test: $(VENV)/.stamp
	$(PY) -m pytest -m gpu -q

lint: $(VENV)/.stamp
	$(PY) -m ruff check swajax pallas_kernels gemma experiments tests

format: $(VENV)/.stamp
	$(PY) -m ruff format swajax pallas_kernels gemma experiments tests
	$(PY) -m ruff check --fix swajax pallas_kernels gemma experiments tests

# Oracle fixtures from Hugging Face transformers (torch, CPU) in their own Python 3.11 venv.
FIXTURE_PYTHON ?= $(shell command -v python3.11 || echo $$HOME/.pyenv/versions/3.11.7/bin/python3.11)
FXVENV := .venv-fixtures
fixtures:
	@test -x $(FXVENV)/bin/python || $(FIXTURE_PYTHON) -m venv $(FXVENV)
	$(FXVENV)/bin/python -m pip install -q torch==2.13.0 transformers==5.17.0 safetensors numpy
	$(FXVENV)/bin/python tests/fixtures/build_fixtures.py

clean:
	rm -rf $(VENV) $(FXVENV) .pytest_cache
