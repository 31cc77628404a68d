# The README's two commands: `make demo` and `make test`. Both set everything up on a fresh machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: demo test test-fast lint typecheck setup sysdeps clean bench-tcp

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[client,dev]"
	@touch $(STAMP)

# System packages the tests use (iperf3 for the tcp benchmark); only as root, never fatal.
sysdeps:
	@scripts/sysdeps.sh

demo: setup
	$(VENV)/bin/weightwire demo

test: setup sysdeps
	$(VPY) -m ruff check .
	scripts/typecheck.sh
	$(VPY) -m pytest -q -ra

test-fast: setup
	$(VPY) -m pytest -q -ra -m "not slow"

bench-tcp: setup sysdeps
	$(VENV)/bin/weightwire bench tcp --json

lint: setup
	$(VPY) -m ruff check .

typecheck: setup
	scripts/typecheck.sh

clean:
	rm -rf $(VENV) build *.egg-info
