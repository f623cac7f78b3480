# The commands people type. `make run` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test test-slow test-ci lint format typecheck docs bench clean-venv help

help:
	@echo "make run        - train on the embedded toy world on a local Ray cluster"
	@echo "make test       - the default test suite (what CI runs)"
	@echo "make test-slow  - the longer end-to-end runs"
	@echo "make test-ci    - the bounded selection of slow runs CI adds"
	@echo "make docs       - regenerate docs/config.md from the config models"
	@echo "make lint       - ruff check + format check; make typecheck - mypy"

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24,<26.2"
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@# the browser test (tests/test_eval_html.py) drives Debian's chromium; never fail for it
	@if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
	      || echo "chromium install failed: tests/test_eval_html.py will skip (apt-get install -y chromium)"; \
	  else \
	    echo "no chromium: tests/test_eval_html.py will skip; install it with: sudo apt-get install -y chromium"; \
	  fi; \
	fi
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/maskgrpo train --config configs/toy.yaml

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu" --timeout=900 --durations=20

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not gpu" --timeout=1800

test-ci: $(STAMP)
	$(PY) -m pytest -q -m "slow and ci and not gpu" --timeout=1200 --durations=20

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

docs: $(STAMP)
	$(VENV)/bin/maskgrpo config-docs --out docs/config.md

bench: $(STAMP)
	$(PY) -m bench.bench_logprob_recompute

clean-venv:
	rm -rf $(VENV)
