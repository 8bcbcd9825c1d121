# Maestro + Quiver: every install step lives here so a fresh machine needs only `make demo` / `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Every install goes through constraints.txt: torch==2.13.0 (CPU wheel on local disk), never a CUDA build.
PIPC   := $(PIP) install -c constraints.txt
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: venv test demo docs lint format bench bench-env reliability clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel -c constraints.txt
	$(PIPC) torch==2.13.0
	$(PIPC) -e '.[serve,serve-docs,dev,hf,scale]'
	touch $(STAMP)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m quiver.demo
	$(PY) -m maestro.demo

# The documentation site (mkdocs.yml) into site/, offline. The `docs` extra is installed here, on
# first use, never by `make venv`. --strict: a broken link, a page missing from the nav or a
# reference that cannot be generated from the code (docs/hooks/reference.py) fails the build.
$(DOCS_STAMP): $(STAMP)
	$(PIPC) -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 HF_HUB_OFFLINE=1 $(PY) -m mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(PY) -m ruff check src tests bench docs/hooks
	$(PY) -m ruff format --check src tests bench docs/hooks

format: $(STAMP)
	$(PY) -m ruff check --fix src tests bench docs/hooks
	$(PY) -m ruff format src tests bench docs/hooks

# Side-by-side benchmarks (long; never part of the tests). reliability.py and gpu_check.sh run
# on their own: `make reliability`, and `bash bench/gpu_check.sh` on a machine with a GPU.
BENCHES := sampling psgs features model_forward serving maestro_throughput maestro_schedule maestro_plan maestro_parallel

bench: $(STAMP)
	@for b in $(BENCHES); do echo "== bench/$$b.py"; $(PY) bench/$$b.py || exit 1; done

reliability: $(STAMP)
	$(PY) bench/reliability.py

# Baseline envs for the benchmarks (.bench-env/pyg: torch-scatter + torch-sparse built from source,
# 20-60 min; .bench-env/dgl: torch 2.2.1 + dgl 2.1.0, ~2.8 GB download). Idempotent; never run by
# test/CI. See docs/quiver/benchmarks.md, "Baseline environments".
bench-env: $(STAMP)
	bench/baselines/build_envs.sh all
	$(PY) bench/baselines/check_envs.py --verify

clean:
	rm -rf $(VENV) build dist site src/*.egg-info .pytest_cache .ruff_cache
