# `make run` and `make test` do all their set-up themselves on a fresh machine.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# A Python >= 3.12: $(PYTHON) if given, else the first found by tools/find_python.sh.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell tools/find_python.sh 2>/dev/null)
endif

.PHONY: run demo test fixtures lint format venv gpu-test clean tiny-model

$(VENV)/.stamp: pyproject.toml constraints.txt
	@if [ -z "$(PYTHON)" ]; then tools/find_python.sh >/dev/null; exit 1; fi
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	@touch $@

venv: $(VENV)/.stamp

run: $(VENV)/.stamp
	$(PY) -m swajax.main

# Text generation from the tiny trained model: a JSONL batch through the CLI's function, a
# streamed chat, KV slot occupancy with scratch reuse on and off, a full-size memory plan.
demo: $(VENV)/.stamp
	$(PY) experiments/quickstart.py

# A test whose xdist worker dies (XLA's CPU compiler segfaulted now and then under jaxlib 0.11,
# mostly writing JAX's persistent cache, which the suite no longer uses: experiments/notes/
# engine.md v23, v26) runs once more in a fresh worker; a test that fails is never run again.
test: $(VENV)/.stamp
	$(PY) -m ruff check swajax pallas_kernels gemma experiments tests
	$(PY) -m ruff format --check swajax pallas_kernels gemma experiments tests
	$(PY) -m pytest -m "not gpu" -n 2 -q --reruns 1 --only-rerun "worker '.*' crashed while running"

# The tiny trained example model (committed under experiments/tiny_model/; this rebuilds it,
# with its Orbax twin in experiments/tiny_model_orbax/). A few CPU minutes.
tiny-model: $(VENV)/.stamp
	$(PY) experiments/train_tiny.py

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
	$(FXVENV)/bin/python -m pip install -q torch==2.13.0 transformers==5.17.0 safetensors numpy sentencepiece protobuf jinja2
	$(FXVENV)/bin/python tests/fixtures/build_fixtures.py

clean:
	rm -rf $(VENV) $(FXVENV) .pytest_cache
