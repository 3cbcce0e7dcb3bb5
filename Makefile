# The README's quick start: `make up` runs nextstate on this machine, `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PIP    := $(VENV)/bin/pip --disable-pip-version-check -q
# torch first, pinned, so the trainer's extra does not pull a multi-GB CUDA build on a CPU machine
TORCH  ?= torch==2.13.0

.PHONY: up test install install-test clean

up: install
	$(VENV)/bin/nextstate up

test: install-test
	$(VENV)/bin/nextstate vllm setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -e . 2>&1 | grep -v "^WARNING: Location" || true
	$(VENV)/bin/nextstate --version
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(PIP) install '$(TORCH)' 2>&1 | grep -v "^WARNING: Location" || true
	$(PIP) install -e '.[test,train,rollout]' 2>&1 | grep -v "^WARNING: Location" || true
	$(VENV)/bin/python -c "import pytest, openai, nextstate.cli, torch, peft, verl"
	touch $(VENV)/.installed $@

clean:
	rm -rf $(VENV) *.egg-info
