# Set-up is part of every target: a fresh machine needs only `make demo` or `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test test-cpu bench clean

$(BIN)/.installed: pyproject.toml requirements-lock.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 resolves to the CPU build that lies on this machine's disk.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements-lock.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/autoplan demo

# Two test processes on a 2-core machine (at most 4 elsewhere: each holds its own gloo rank
# pools), tests handed out as workers free up (xdist's worksteal).
test: venv
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal --durations=15 tests

# CPU seconds per test (ranks and subprocesses included) into out/test_cpu.json, the slowest
# first: where the suite's time goes, whatever the machine's load (tests/cpu_profile.py). Run
# as `make test` runs; each worker counts its own process tree.
test-cpu: venv
	CPU_PROFILE_OUT=out/test_cpu.json $(BIN)/python -m pytest -q -p tests.cpu_profile \
		-n auto --maxprocesses 4 --dist worksteal tests

bench: venv
	$(BIN)/python bench/plan_speed.py

clean:
	rm -rf $(VENV) out
