# The course's commands. Everything runs inside .venv, created on first use.
#
#   make lab      install if needed, start JupyterLab on the repository root, opened on notebooks/
#                 (the root is served so that the notebooks' ../images/*.png links load), with the course's
#                 Lab defaults from .jupyter/labconfig/default_setting_overrides.json (no Jupyter news fetched,
#                 so no "get notified about official Jupyter news?" pop-up; a learner's own settings still win)
#   make test     install if needed, lint (ruff, then import-linter's layer contracts), run the whole test suite
#                 (notebooks included)
#   make test-portability  the numerically sensitive tests under each ATEN_CPU_CAPABILITY the CPU has
#   make gpu-check  on a machine with GPUs: the CUDA tests, NCCL test cases, every recipe on CUDA, lslm doctor and
#                 calibration measurements, in under five minutes, into bench/results/gpu/<gpu>_<date>.json
#                 (lslm.bench.gpu_check); without a GPU it says so and exits 0;
#                 GPU_CHECK_ARGS="--only calibrate:recompute" runs only the steps named
#
# Variables (override on the command line, e.g. `make lab PORT=9999`):
#   PYTHON       interpreter used to create .venv (Python >= 3.10)
#   TORCH        the torch requirement installed first. On Linux, PyPI's torch==2.13.0
#                is the CUDA build, so GPU users need nothing else; for another CUDA
#                version use e.g. TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu126"
#   TORCH_INDEX  extra pip arguments for the torch install
#   DEEPSPEED    the DeepSpeed requirement, installed after torch (must match pyproject.toml's pin)
#   PORT         JupyterLab port;  LAB_ARGS  extra `jupyter lab` arguments
#   PYTEST_ARGS  extra pytest arguments (e.g. PYTEST_ARGS="tests/test_grid.py -x")
#   GPU_CHECK_ARGS  extra `lslm gpu-check` arguments (e.g. GPU_CHECK_ARGS="--only calibrate:recompute")

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
PORT ?= 8888
# DeepSpeed (the [test] extra pins the same version): an sdist whose setup imports torch, so it is installed after
# torch, against it (--no-build-isolation: otherwise pip would build it against a fresh CUDA torch), with
# DS_BUILD_OPS=0 (no C++ op is built at install; ZeRO training here needs none: see lslm.integrations.deepspeed_zero)
DEEPSPEED ?= deepspeed==0.19.8
LAB_ARGS ?=
PYTEST_ARGS ?=
GPU_CHECK_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.lslm-installed
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: setup lab test test-portability lint notebooks doctor gpu-check clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "lslm needs Python >= 3.10; set PYTHON=python3.x")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(TORCH_INDEX)
	$(BIN)/python -m pip install --quiet "setuptools>=64" wheel  # what a build without isolation needs (3.12's venv has none)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation $(DEEPSPEED)
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

# The root is served (not notebooks/) so that ../images/*.png resolves; the browser opens on notebooks/.
# JUPYTER_CONFIG_PATH adds .jupyter/ to Jupyter's config search path: jupyterlab_server reads setting
# defaults from <config path>/labconfig/default_setting_overrides.json.
lab: setup
	JUPYTER_CONFIG_PATH="$(CURDIR)/.jupyter$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" $(BIN)/jupyter lab --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/notebooks \
		--port=$(PORT) $(ROOT_FLAG) $(LAB_ARGS)

test: setup lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The tests most sensitive to float32 rounding, rerun under each of torch's CPU kernel sets the CPU supports
# (ATEN_CPU_CAPABILITY: what another machine's kernels would do; README "Tests"). Not part of `make test`: three
# passes would not fit the CI's time.
PORTABILITY_TESTS ?= tests/test_zero.py tests/test_hsdp.py tests/test_zero_deepspeed.py tests/test_three_d.py \
	tests/test_three_d_demo.py tests/test_onebit_adam.py tests/test_ddp.py tests/test_tp_dtensor.py \
	tests/test_pipeline_torch_reference.py tests/test_recipe_zero.py notebooks
CAPABILITIES ?= default $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo avx2) \
	$(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo avx512)

test-portability: setup
	for cap in $(CAPABILITIES); do \
		echo "== ATEN_CPU_CAPABILITY=$$cap"; \
		ATEN_CPU_CAPABILITY=$$cap $(BIN)/python -m pytest -p no:cacheprovider $(PORTABILITY_TESTS) $(PYTEST_ARGS) || exit 1; \
	done

# ruff (configured in pyproject.toml) over the package, tests and image scripts, then import-linter's contracts
# (the package's layers and no import cycles, docs/architecture.md); runs first in `make test`.
lint: setup
	$(BIN)/python -m ruff check .
	$(BIN)/lint-imports

# Re-execute every notebook in place (outputs committed, so readers see results first), then normalise them
# (kernelspec as installed, no run timestamps or widget state, text progress bars as their final line), so a
# re-run leaves a diff only where outputs really changed. Run the script by hand after saving from JupyterLab.
notebooks: setup
	for nb in notebooks/[0-9]*.ipynb; do \
		$(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=600 "$$nb" || exit 1; \
	done
	$(BIN)/python scripts/normalize_notebooks.py notebooks/[0-9]*.ipynb

doctor: setup
	$(BIN)/lslm doctor

# Runs from the repository root (the test steps need tests/); `lslm gpu-check --dry-run` shows the plan anywhere.
gpu-check: setup
	$(BIN)/lslm gpu-check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
