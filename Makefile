# Two set-up commands on a fresh machine: `make run` and `make test`.
SHELL  := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
CONFIG ?= configs/ranking.yaml
# Which TensorFlow to install into .venv: cpu (tensorflow-cpu), tf or tpu (Cloud TPU VMs).
TF_FLAVOUR ?= cpu
# TF_CPP_MIN_LOG_LEVEL hides TensorFlow's C++ start-up chatter; errors still show.
export TF_CPP_MIN_LOG_LEVEL ?= 2
# Native kernels (docs/native_kernels.md): built against the installed
# TensorFlow into this repo-local cache, by `make install` and on first use;
# `make test` uses the same cache (tests never read ~/.cache).
export TPU_EMBED_EXT_CACHE_DIR ?= $(CURDIR)/.cache
# Test processes (pytest-xdist): each takes whole test files (--dist loadfile),
# so a module's fixtures (a trained model_dir, say) are built once.
TEST_WORKERS ?= 2
# The longest test files, handed out first (pytest collects a file once), so
# that no long file starts last and runs alone at the end.
SLOW_FIRST := tests/test_notebooks.py tests/test_emulated_job.py \
	tests/test_emulated_job_sparsecore.py tests/test_fault_injection.py \
	tests/test_wheel.py tests/test_emulated_keras_multi_hot.py

.PHONY: run test bench docs install dist clean

# TensorFlow's C++ start-up lines, printed on some CPUs whatever
# TF_CPP_MIN_LOG_LEVEL says: not the install's to show.
TF_STARTUP := -e '/^WARNING: All log messages before absl::InitializeLog/d' -e '/^I0000 /d'

# One line per stage, with what it costs, before it runs (pip -q is silent for
# minutes otherwise); the kernels' compile says so itself (loader.py), once.
$(VENV)/.installed: setup.py
	@echo "make install: 1/3 creating $(VENV) (a few seconds)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "make install: 2/3 installing TensorFlow ($(TF_FLAVOUR)) and tpu_embed_ext, about 2 minutes"
	@$(PIP) install -e '.[$(TF_FLAVOUR)]' 2>&1 | sed '/is ignored: it is neither/d'
	@echo "make install: 3/3 installing the data and test tools (tfds, matplotlib, pytest, mkdocs), about 1 minute"
	@$(PIP) install -e '.[$(TF_FLAVOUR),test]' 2>&1 | sed '/is ignored: it is neither/d'
	@$(PY) -c "import tensorflow, tpu_embed_ext" 2>&1 | sed $(TF_STARTUP)
	@$(PY) -m tpu_embed_ext.emulation.native build 2>&1 | sed $(TF_STARTUP)
	@echo "make install: done; next: make run (about 5 minutes) or make test (about 30 minutes on 2 cores)"
	@touch $@

install: $(VENV)/.installed

run: install
	$(PY) -m tpu_embed_ext train --config $(CONFIG)

test: install
	$(PY) -m tpu_embed_ext.emulation.native build
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(SLOW_FIRST) tests

$(VENV)/.bench-installed: $(VENV)/.installed
	$(PIP) install -e '.[$(TF_FLAVOUR),test,bench]' 2>&1 | sed '/is ignored: it is neither/d'
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) -m benchmarks.run_all
	$(PY) -m benchmarks.native
	$(PY) -m benchmarks.replicas
	$(PY) -m benchmarks.convert_checkpoint
	$(PY) -m benchmarks.emulation
	$(PY) -m benchmarks.emulation --xla-costs
	$(PY) -m benchmarks.replica_suite
	$(PY) -m benchmarks.job_tpu
	$(PY) -m benchmarks.keras_step

# The documentation site, built offline into site/ (fails on a broken link or
# a missing API symbol; tests/test_docs.py runs the same build in `make test`).
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

# The wheel and the sdist, into dist/ (pip builds the wheel in an isolated
# environment: setuptools and wheel come from the index, nothing else).
dist:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -rf dist build
	$(PY) -m pip --disable-pip-version-check wheel -q --no-deps -w dist . 2>&1 | sed '/is ignored: it is neither/d'
	$(PY) setup.py -q sdist -d dist 2>&1 | sed '/standard file not found/d'
	rm -rf build *.egg-info
	@ls dist

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache site .cache dist build
