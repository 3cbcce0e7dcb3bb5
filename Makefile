# The README's quick start: `make up` runs nextstate on this machine, `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PIP    := $(VENV)/bin/pip --disable-pip-version-check -q
# torch first, pinned, so the trainer's extra does not pull a multi-GB CUDA build on a CPU machine:
# with no GPU (no working nvidia-smi) the CPU build, +cpu, from a local wheel or index where pip
# has one, else from PyTorch's CPU index
TORCH  ?= torch==2.13.0
GPU    := $(shell nvidia-smi >/dev/null 2>&1 && echo 1)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

# The suite in tiers (docs/testing.md): tests/conftest.py marks each test `vllm`, `browser`, `agent` or
# `processes` by the fixtures it uses and what its module imports. `make test` runs every tier;
# `make test-fast`, while you change code, only the tests that need none of them (no vLLM, no chromium,
# no npm agent, no gateway/worker/upstream process or throwaway database of their own).
FAST   ?= not vllm and not browser and not agent and not processes
# Workers (pytest-xdist; 0 runs in one process; docs/testing.md): the fast tier on JOBS (2), a module at
# a time on each; the whole suite on TEST_JOBS (3), a group at a time: the modules that use the shared
# vLLM servers are one group on one worker (one pair of servers), the real agents' modules another (a
# server of their own), every other module a group of its own
JOBS      ?= 2
TEST_JOBS ?= 3
xdist = $(if $(filter-out 0,$(1)),-n $(1) --dist $(2))
# A failed test is run once more (pytest-rerunfailures); one that passes then is a flake: the run stays
# green and tests/support/flakes.py writes it to tests/flakes.md and prints it (docs/testing.md).
# RERUNS=0 runs each test once.
RERUNS ?= 1

.PHONY: up test test-fast install install-test torch browser openclaw clean

up: install
	$(VENV)/bin/nextstate up

test: install-test browser openclaw
	$(VENV)/bin/nextstate vllm setup
	$(VENV)/bin/python -m pytest $(call xdist,$(TEST_JOBS),loadgroup) --reruns $(RERUNS) $(PYTEST_ARGS)

test-fast: install-test
	$(VENV)/bin/python -m pytest $(call xdist,$(JOBS),loadfile) --reruns $(RERUNS) -m "$(FAST)" $(PYTEST_ARGS)

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# what `up`, `up --train`, `train` and `rollout` need
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(MAKE) --no-print-directory torch
	$(PIP) install -e '.[train,rollout]' 2>&1 | grep -v "^WARNING: Location" || true
	$(VENV)/bin/python -c "import nextstate.cli, torch, peft, openai"
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(MAKE) --no-print-directory torch
	$(PIP) install -e '.[test,train,rollout,bench]' 2>&1 | grep -v "^WARNING: Location" || true
	$(VENV)/bin/python -c "import pytest, xdist, pytest_rerunfailures, openai, nextstate.cli, torch, peft, verl, matplotlib"
	touch $(VENV)/.installed $@

torch: | $(VENV)/bin/python
ifeq ($(GPU),1)
	$(PIP) install '$(TORCH)' 2>&1 | grep -v "^WARNING: Location" || true
else
	$(PIP) install '$(TORCH)+cpu' 2>/dev/null || $(PIP) install --extra-index-url $(TORCH_CPU_INDEX) '$(TORCH)+cpu'
endif

# The admin UI's browser tests drive Debian's chromium through Playwright (executable_path;
# Playwright's own browser downloads are never used). Installed once, skipped when present.
browser:
	@command -v chromium >/dev/null 2>&1 || { s=""; [ "$$(id -u)" = 0 ] || s=sudo; \
	  $$s apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$s apt-get install -y -qq chromium; }

# tests/agents/test_openclaw.py runs the real OpenClaw agent: Node 24 and OpenClaw from npm into the cache
# (~/.cache/nextstate/openclaw; ~40 s the first time, instant after). Needs npm (any version).
openclaw: install-test
	@command -v npm >/dev/null 2>&1 || { s=""; [ "$$(id -u)" = 0 ] || s=sudo; \
	  $$s apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$s apt-get install -y -qq npm; }
	$(VENV)/bin/python -m tests.support.openclaw_agent install

clean:
	rm -rf $(VENV) *.egg-info
