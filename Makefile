# apportion: every target creates .venv (editable install with dev extras) when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-slow bench outcomes lint typecheck venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

run: $(STAMP)
	$(PY) -m apportion simulate --compare

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q

test-slow: $(STAMP)
	$(PY) -m pytest -q

outcomes: $(STAMP)
	$(PY) -m apportion outcomes $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/run.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/typecheck.py

typecheck: $(STAMP)
	$(PY) scripts/typecheck.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
