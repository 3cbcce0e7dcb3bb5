# The README's quick start: `make up` runs nextstate on this machine, `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PIP    := $(VENV)/bin/pip --disable-pip-version-check -q
# torch first, pinned, so the trainer's extra does not pull a multi-GB CUDA build on a CPU machine
TORCH  ?= torch==2.13.0

.PHONY: up test install install-test browser openclaw clean

up: install
	$(VENV)/bin/nextstate up

test: install-test browser openclaw
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
	$(PIP) install -e '.[test,train,rollout,bench]' 2>&1 | grep -v "^WARNING: Location" || true
	$(VENV)/bin/python -c "import pytest, openai, nextstate.cli, torch, peft, verl, matplotlib"
	touch $(VENV)/.installed $@

# The admin UI's browser tests drive Debian's chromium through Playwright (executable_path;
# Playwright's own browser downloads are never used). Installed once, skipped when present.
browser:
	@command -v chromium >/dev/null 2>&1 || { s=""; [ "$$(id -u)" = 0 ] || s=sudo; \
	  $$s apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$s apt-get install -y -qq chromium; }

# tests/test_openclaw.py runs the real OpenClaw agent: Node 24 and OpenClaw from npm into the cache
# (~/.cache/nextstate/openclaw; ~40 s the first time, instant after). Needs npm (any version).
openclaw: install-test
	@command -v npm >/dev/null 2>&1 || { s=""; [ "$$(id -u)" = 0 ] || s=sudo; \
	  $$s apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$s apt-get install -y -qq npm; }
	$(VENV)/bin/python -m tests.openclaw_agent install

clean:
	rm -rf $(VENV) *.egg-info
