# Two entry points: `make demo` and `make test`. Both create .venv if missing and install once
# (re-installing only when pyproject.toml or constraints.txt change).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.install-stamp
NPROC ?= 2

.PHONY: install kernels bytecode demo demo-strategy movielens test test-unit lint clean torchrec-peer recbole-peer

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt Makefile
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]" \
		--config-settings editable_mode=compat
	touch $(STAMP)

install: $(STAMP)

# The recommender example: sharded tables + DDP MLPs, validation AUC, checkpoints, metrics.png.
demo: install
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) \
		examples/recsys/train.py --out runs/demo

# SASRec on MovieLens-100k (fetched once into ~/.cache/manualpar), RecBole's protocol; prints
# HR/NDCG/MRR of the best checkpoint beside a popularity baseline (docs/examples/movielens.md).
movielens: install
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) \
		examples/movielens/train.py --out runs/movielens --no-progress

demo-strategy: install
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) \
		examples/strategy_demo.py --out runs/strategy_demo

# Lint, format and types: ruff (rules and formatting) over everything, mypy over the package
# and the examples. Each example folder is a set of scripts of its own (model.py, data.py and
# train.py repeat across folders), so mypy takes one folder at a time; the benchmarks import
# the recsys example's modules. The examples add about 4 s of CPU to the package's 12.
EXAMPLE_DIRS := dcn mixed_parallel movielens recsys two_tower torchx

lint: install
	$(PY) -m ruff check manualpar tests examples
	$(PY) -m ruff format --check manualpar tests examples
	$(PY) -m mypy manualpar
	MYPYPATH=examples/recsys $(PY) -m mypy examples/benchmarks examples/strategy_demo.py
	for d in $(EXAMPLE_DIRS); do $(PY) -m mypy examples/$$d || exit 1; done

# The C++ embedding kernels: built once per machine and source version (about 40 s), before the
# tests start ranks; without a compiler this warns and the torch path is used.
kernels: install
	$(PY) -c "from manualpar.embeddings.kernels.native import native_kernels; native_kernels()"

# The whole suite on 2 worker processes (pytest-xdist): a test's ranks and launched jobs spend
# part of their time starting and waiting, which the other worker's test fills. loadscope keeps
# each test file on one worker, so a module-scoped fixture (e.g. one training run shared by a
# file's tests) runs once; tests/conftest.py hands out the files of tests/e2e first, so that no
# long one is left to a single worker at the end (tests/support/heavy_first.py).
TEST_WORKERS ?= 2

# Bytecode compiled once up front: where PYTHONDONTWRITEBYTECODE is set (as on CI machines), each
# of the suite's ranks, launchers and examples compiled the package from source again: `import
# manualpar` took 1.86 s against 1.47 s. Measured over one suite run each: 27 s less CPU, and
# 309 s of pytest against 330 s.
bytecode: install
	$(PY) -m compileall -q manualpar tests examples

test: install lint kernels bytecode
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

# The single-process tests only (tests/unit: no process is started), in about 30 s.
test-unit: install kernels
	$(PY) -m pytest -q tests/unit

# The TorchRec + FBGEMM (CPU) peer of the embedding benchmark, in its own environment.
TORCHREC_PYTHON ?= python3.11
TORCHREC_VENV := .venv-torchrec
TORCHREC_PIP := $(TORCHREC_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
	-c examples/benchmarks/torchrec-constraints.txt

torchrec-peer:
	$(TORCHREC_PYTHON) -m venv $(TORCHREC_VENV)
	$(TORCHREC_PIP) "torch==2.13.0"
	$(TORCHREC_PIP) --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0
	$(TORCHREC_PIP) tensordict torchmetrics==1.0.3 tqdm pyre-extensions numpy

# The RecBole 1.2.1 SASRec peer of the MovieLens example, in its own environment. --no-deps:
# RecBole's requirements pull ray, plotly, thop, psutil and tabulate, which a SASRec run never
# calls (peer_recbole.py stands in for the `ray` that recbole/__init__ imports), and tensorboard's
# pull its web server (grpcio, werkzeug, markdown): the trainer's SummaryWriter needs only
# protobuf and absl-py. Run: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set by the script itself,
#   .venv-recbole/bin/python examples/movielens/peer_recbole.py --seed 2020 --json out.json
RECBOLE_PYTHON ?= python3.11
RECBOLE_VENV := .venv-recbole
RECBOLE_PIP := $(RECBOLE_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
	-c examples/movielens/recbole-constraints.txt

recbole-peer:
	$(RECBOLE_PYTHON) -m venv $(RECBOLE_VENV)
	$(RECBOLE_PIP) "torch==2.13.0"
	$(RECBOLE_PIP) --no-deps recbole==1.2.1 tensorboard
	$(RECBOLE_PIP) numpy scipy pandas scikit-learn tqdm pyyaml texttable colorlog colorama \
		protobuf packaging absl-py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
