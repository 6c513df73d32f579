# apportion: every target creates .venv (editable install with dev extras) when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-slow bench outcomes lint typecheck venv clean browser promtool slurm

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,plot]'
	@touch $(STAMP)

run: $(STAMP)
	$(PY) -m apportion simulate --compare

test: $(STAMP) browser promtool slurm
	$(PY) -m pytest -m "not slow" -q

test-slow: $(STAMP) browser promtool slurm
	$(PY) -m pytest -q

# The dashboard's browser test drives Debian's chromium (Playwright via executable_path).
# Install it when missing and we are root; never fail: without it that test skips.
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "browser: installing chromium (apt-get) for the dashboard's browser test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
			|| echo "browser: could not install chromium; the browser test will skip"; \
	else echo "browser: no chromium (not root, or no apt-get); the browser test will skip"; fi

# The metrics test checks /metrics with promtool (Debian's prometheus package). Install it
# when missing and we are root; never fail: without it that test skips.
promtool:
	@if command -v promtool >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "promtool: installing prometheus (apt-get) for the metrics format test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null 2>&1 \
			|| echo "promtool: could not install prometheus; the promtool test will skip"; \
	else echo "promtool: not root or no apt-get; the promtool test will skip"; fi

# The Slurm bridge's tests start a real slurmctld and slurmd (Debian's slurm-wlm and munge).
# Install them when missing and we are root; never fail: without them those tests skip.
slurm:
	@if command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 \
		&& command -v munged >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "slurm: installing slurm-wlm and munge (apt-get) for the Slurm bridge's tests"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge) >/dev/null 2>&1 \
			|| echo "slurm: could not install slurm-wlm; the Slurm tests will skip"; \
	else echo "slurm: not root or no apt-get; the Slurm tests will skip"; fi

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
