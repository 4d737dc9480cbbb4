# Two entry points that set themselves up on a fresh machine: `make demo` and `make test`. Each installs fp8stack
# (editable) into .venv with only the extras it uses; the venv's Python is >= 3.12 because the tests use megatron-core.
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS_demo := plot
EXTRAS_test := test,plot,megatron,tb

.PHONY: demo test test-gpu venv deepgemm clean

$(VENV)/.created: scripts/find-python.sh
	@PYBIN=$$(scripts/find-python.sh) || exit 1; \
	  echo "creating $(VENV) with $$PYBIN"; \
	  $$PYBIN -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@touch $@

$(VENV)/.installed-%: pyproject.toml $(VENV)/.created
	$(PY) -m pip install -q -e '.[$(EXTRAS_$*)]'
	@touch $@

venv: $(VENV)/.installed-test

# A fresh folder under runs/ (git-ignored) per demo: the tracked evidence in profiles/ stays as recorded.
demo: $(VENV)/.installed-demo
	$(VENV)/bin/fp8stack ab --model tiny --out-dir runs/demo-$$(date -u +%Y%m%d-%H%M%S)

# Two pytest-xdist workers (one per core of CI's 2-core machine), each test file on one worker (its module fixtures
# are computed once, and test_launch's fixed rendezvous ports never meet); tests/conftest.py gives each worker one
# thread and puts the longest files first, which --no-loadscope-reorder keeps (xdist would start the files with the
# most tests first). pytest still exits 5 when no test ran. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-gpu: $(VENV)/.installed-test
	$(PY) -m pytest -m gpu

# The [deepgemm] extra has no pip-installable form: DeepGEMM is built from its SHA-256-pinned sdist against the
# venv's torch (needs nvcc 12.9+ and GCC 13+) and installed into the venv.
deepgemm: $(VENV)/.installed-test
	PYTHON=$(PY) launch/build_deepgemm.sh

clean:
	rm -rf $(VENV) .pytest_cache
