# Quick start: `make train` and `make test`. Both create/refresh .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=
# Test processes (pytest-xdist): one per core, at most 4 (each holds 8 simulated devices); 0 runs in this process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

.PHONY: install train test bench clean

install: $(STAMP)

# Re-installs whenever pyproject.toml changes (or the venv is missing).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -e ".[test]"
	touch $(STAMP)

train: install
	$(VENV)/bin/megajax train $(ARGS)

bench: install
	$(VENV)/bin/megajax bench $(ARGS)

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=40 $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
