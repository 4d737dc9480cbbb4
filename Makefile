# Two entry points that set themselves up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-gpu venv clean

$(STAMP): pyproject.toml scripts/find-python.sh
	@PYBIN=$$(scripts/find-python.sh) || exit 1; \
	  echo "creating $(VENV) with $$PYBIN"; \
	  $$PYBIN -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,plot]'
	@touch $(STAMP)

venv: $(STAMP)

# A fresh folder under runs/ (git-ignored) per demo: the tracked evidence in profiles/ stays as recorded.
demo: $(STAMP)
	$(VENV)/bin/fp8stack ab --model tiny --out-dir runs/demo-$$(date -u +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(PY) -m pytest

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu

clean:
	rm -rf $(VENV) .pytest_cache
