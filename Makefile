# Two commands do everything on a fresh machine with Python 3.11+ and make:
#   make demo   -- create .venv, install, run the main job on the embedded defaults
#   make test   -- create .venv, install with test extras (and docs: the site is built), run the whole suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint docs bench clean mutation

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -e '.[test,parity,docs,lmeval]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tenantq formats
	$(VENV)/bin/tenantq capacity --compare --model llama-3.1-8b --hardware tpu-v6e --chips 1 --context 8192
	$(VENV)/bin/tenantq capacity --compare --model tenantq-ref --hardware cpu --memory 1GiB --context 1024
	@# The quickstart study: tenants vs quality on the reference model, 2 CPU workers; a second
	@# `make demo` resumes the finished study and prints its front again.
	JAX_PLATFORMS=cpu $(VENV)/bin/tenantq search experiments/quickstart.toml --resume-or-start
	JAX_PLATFORMS=cpu $(VENV)/bin/tenantq report --experiment quickstart --out reports/quickstart
	@echo "report: reports/quickstart/report.html"
	@echo "MLflow UI:        $(VENV)/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000"
	@echo "optuna-dashboard: $(VENV)/bin/optuna-dashboard sqlite:///optuna.db --host 127.0.0.1 --port 8080"

# Two pytest-xdist workers; `--dist loadgroup` keeps the `serial` group (every `e2e` test and
# tests/cluster/: Ray clusters, servers, ports; tests/conftest.py) on one worker, one at a time.
XDIST := -n 2 --dist loadgroup

# pytest exits 5 when it collected nothing: say so plainly instead of failing obscurely.
test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q $(XDIST); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5)"; exit 0; fi; exit $$rc

test-fast: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q $(XDIST) -m "not slow and not e2e"

# The docs site (mkdocs.yml, docs/) into site/; --strict fails on any warning, as tests/test_docs.py does.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(VENV)/bin/ruff check platform tests
	$(VENV)/bin/ruff format --check platform tests

# Mutation testing (mutmut) of numerics/, capacity/, the engine's allocator, paged store and
# pool, and quant/plan.py against their own tests; prints each score and the survivors.
# Slow (minutes to hours): not part of `make test`. TARGETS="allocator pool" runs a subset.
mutation: $(STAMP)
	$(PY) -m pip install --quiet -e '.[mutation]'
	$(PY) mutation/run.py $(TARGETS)

clean:
	rm -rf $(VENV) .pytest_cache
