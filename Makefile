# Two entry points: `make demo` and `make test`. Both create .venv if missing and install once
# (re-installing only when pyproject.toml or constraints.txt change).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.install-stamp
NPROC ?= 2

.PHONY: install demo test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) \
		examples/strategy_demo.py --out runs/demo

lint: install
	$(PY) -m ruff check manualpar tests examples

test: install lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
