# The README's two commands: `make demo` and `make test`. Both set everything up on a fresh machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
MCORE := megatron-core==0.16.1

.PHONY: demo test test-fast lint typecheck setup sysdeps clean bench-tcp test-sglang test-rdma

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/verl-requirements.txt
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[client,sglang,metrics,dev]"
	$(VPY) -m pip install -q --no-deps "$(MCORE)"  # its deps (numpy, packaging, torch) are here
	$(VPY) -m pip install -q --no-deps -r scripts/verl-requirements.txt  # verl 0.9.1 for -m verl
	@$(VPY) -m pip install -q atheris 2>/dev/null || echo "atheris did not install: fuzzing runs on hypothesis alone"
	@touch $(STAMP)

# System packages the tests use (iperf3 for the tcp benchmark); only as root, never fatal.
sysdeps:
	@scripts/sysdeps.sh

demo: setup
	$(VENV)/bin/weightwire demo

# Every stage runs even when an earlier one fails, so one CI run reports everything.
test: setup sysdeps
	@rc=0; \
	echo "== ruff"; $(VPY) -m ruff check . || rc=1; \
	echo "== mypy (strict: protocol, transport, memory, daemon, plan, client)"; scripts/typecheck.sh || rc=1; \
	echo "== pytest"; $(VPY) -m pytest -q -ra || rc=1; \
	echo "== rdma (Soft-RoCE VM)"; \
	why=$$(RDMA_VM_TORCH=1 scripts/rdma-vm.sh --setup-only 2>&1); st=$$?; \
	if [ $$st = 0 ]; then $(MAKE) --no-print-directory test-rdma || rc=1; \
	elif [ $$st = 77 ]; then echo "RDMA tests not run: $$(echo "$$why" | tail -n1 | sed 's/^rdma-vm: skipped: //')"; \
	else echo "$$why" | tail -n5; echo "RDMA VM setup failed ($$st)"; rc=1; fi; \
	exit $$rc

# The verbs transport on real (Soft-RoCE) RDMA devices inside a QEMU VM: the transport
# conformance suite and an end-to-end update through two daemons (needs root; see
# scripts/RDMA_NOTES.md). `make test` runs it when it can and says why not otherwise.
RDMA_TESTS := tests/test_transport_rdma.py tests/rdma
test-rdma:
	RDMA_VM_TORCH=1 scripts/rdma-vm.sh -- python -m pytest -q -ra -p no:cacheprovider -m rdma $(RDMA_TESTS)

# weightwire's recipes against SGLang 0.5.23's own model classes and loaders, on CPU.
test-sglang:
	scripts/sglang-env.sh
	.venv-sglang/bin/python -m pytest -q tests/sglang

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
