# dsv4cp: `make demo` (install + CP prefill demo) and `make test` (the CI suite) from a clean clone.
PYTHON ?= python3
VENV ?= .venv
SGL_VENV ?= .venv-sglang
PY := $(VENV)/bin/python
SGL_PY := $(SGL_VENV)/bin/python

.PHONY: install install-sglang demo test test-core test-sglang test-gpu lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@echo "make: installing dsv4cp and torch into $(VENV) (about 3 min the first time; pip runs quietly)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install-sglang: $(SGL_VENV)/.installed

# The sglang venv sees the core venv's packages through a .pth file (appended after its own
# site-packages), so torch, triton and the CUDA wheels (~5 GB) are installed once, not twice;
# what sglang pins differently is installed into .venv-sglang and shadows the core copy.
$(SGL_VENV)/.installed: pyproject.toml $(VENV)/.installed
	@echo "make: installing sglang 0.5.23 into $(SGL_VENV) (about 6 min, ~5 GB; pip runs quietly)"
	$(PYTHON) -m venv $(SGL_VENV)
	$(SGL_PY) -c 'import pathlib, sys, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "dsv4cp_core_venv.pth").write_text(sys.argv[1] + "\n")' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(SGL_PY) -m pip install -q --upgrade pip
	$(SGL_PY) -m pip install -q -e '.[dev,sglang]'
	touch $@

demo: install
	$(PY) -m dsv4cp demo

test: test-core test-sglang

test-core: install lint
	$(PY) -m pytest -q -m "not gpu and not sglang"

test-sglang: install-sglang
	$(SGL_PY) -m pytest -q -m sglang tests/sglang

# On a CUDA machine (not in CI): the tests marked gpu (kernels against their twins, the model
# against DeepSeek's reference with the kernels, fake-CP streams and graphs).
# one pytest per file: each file's failure report prints as it ends, so a run cut off by a time
# limit still shows the reasons of the files it finished
test-gpu: install
	@rc=0; for f in $$(grep -rlE "mark\.gpu|pytest\.mark\.gpu" tests --include='test_*.py' | sort); do \
		$(PY) -m pytest -q -m gpu -rfE --tb=short $$f || [ $$? -eq 5 ] || rc=1; \
	done; exit $$rc

lint: install
	$(VENV)/bin/ruff check python tests benchmarks
	$(VENV)/bin/ruff format --check python tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(SGL_VENV) build *.egg-info
