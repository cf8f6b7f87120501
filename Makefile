# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
JOB_VENV := .venv-job
UV := $(VENV)/bin/uv

.PHONY: setup demo test test-deps lint bench clean

setup: $(VENV)/.ok $(JOB_VENV)/.ok

# The orchestrator's environment: Prefect and the package; never torch or axolotl.
# Compiled to bytecode once here: where PYTHONDONTWRITEBYTECODE is set (it is on these
# machines), each process would otherwise compile Prefect again (about 5 s of a core).
$(VENV)/.ok: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check uv
	$(UV) pip install -q --compile-bytecode --python $(VENV)/bin/python -e '.[dev]'
	touch $@

# The job environment the local target names: axolotl 0.21 on Python 3.12 (found on the
# PATH or in pyenv; JOB_ENV_PYTHON=/path/to/python3.12 names one), torch, llama.cpp.
# A job env of another Python is built beside it and renamed into place.
JOB_ENV_PYTHON ?=
$(JOB_VENV)/.ok: scripts/job-env.sh scripts/job-constraints.txt $(VENV)/.ok
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" JOB_ENV_PYTHON="$(JOB_ENV_PYTHON)" scripts/job-env.sh $(JOB_VENV)
	touch $@

lint: $(VENV)/.ok
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The system packages the tests need (sshd, PostgreSQL, Chromium) are installed when missing,
# while the venvs are made and linted (a sub-make with 3 jobs, each job's output kept whole):
# apt waits on the network and the disk, the lint needs only the orchestrator's venv.
# Most tests wait (sshd, simulated boots, Prefect servers), so TEST_WORKERS pytest-xdist
# workers overlap the waits, one module (or one shared session fixture) per worker
# (tests/scheduling.py). Four on 2 cores: on a quiet machine (2026-12-05, later the same day
# as a try of four that took 23.5 min against three's 20), three took 21:46 and 22:17 and four
# 21:11 and 21:50 (the second with a sampler of every process's CPU running): the cores are busy
# about 80% of the time at either count, and a fourth worker fills some of the rest.
# The package and the tests are compiled first, as the venv is (PYTHONDONTWRITEBYTECODE).
TEST_WORKERS ?= 4
test:
	@$(MAKE) --no-print-directory -j 3 --output-sync=target setup lint test-deps
	$(VENV)/bin/python -m compileall -q overbrainer_prefect tests bench demo > /dev/null
	$(VENV)/bin/pytest -ra --durations=15 -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test-deps:
	scripts/test-deps.sh

demo: setup
	$(VENV)/bin/python demo/run_demo.py

# Every figure a ratio against a reference measured side by side (see bench/*.py);
# each script makes its own fixtures and prints BENCH lines, or one BENCH-ERROR line.
# bench/kit/run_all.py runs them in turn against one shared Prefect server (a script
# run alone starts its own), the package compiled first as for the tests; the scripts
# that mostly wait and whose figures cannot be flattered by a neighbour's load run as one
# block beside each other (its TOGETHER, and why, in its docstring).
bench: setup
	@$(VENV)/bin/python bench/kit/run_all.py

clean:
	rm -rf $(VENV) $(JOB_VENV) $(JOB_VENV).new .cache
