# PowerDDL developer entry points. Every target installs what is missing into .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.powerddl-installed
PYTEST_ARGS ?=

.PHONY: install demo test test-fast bench lint docs conda clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[torch,mpi,dev]'
	@touch $@

install: $(STAMP)

demo: install
	$(BIN)/python examples/demo.py 1,2

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: install
	$(BIN)/ddl-perf allreduce --ranks 2,4 --compare ddl,ddl-heap,gloo,mpi

lint: install
	$(BIN)/ruff check .

docs: install
	$(BIN)/ddl-perf env --markdown > .env-table.md
	$(BIN)/python -c "import re,sys; p='docs/tuning.md'; s=open(p).read(); t=open('.env-table.md').read().rstrip(); a=s.index('| variable | default | meaning |'); b=s.index('\n\n', a); open(p,'w').write(s[:a]+t+s[b:])"
	@rm -f .env-table.md
	$(BIN)/python -m pytest -q tests/core/test_docs.py

# conda packages into $(CONDA_OUT) (a local channel). With conda-build on PATH: the real
# thing. Without it: recipes/tools/localbuild.py builds the noarch powerddl package from the same
# rendered recipe and indexes the channel with py-rattler (see docs/install.md for the limits).
CONDA_OUT ?= build/conda-bld

conda: install
	@if command -v conda-build >/dev/null 2>&1; then \
	  echo "make conda: using conda-build ($$(command -v conda-build))"; \
	  conda build recipes/powerddl -m recipes/conda_build_config.yaml --output-folder $(CONDA_OUT) && \
	  conda index $(CONDA_OUT); \
	else \
	  echo "make conda: conda-build is not on PATH; building with recipes/tools/localbuild.py" \
	       "(py-rattler + conda-package-handling, not conda-build)"; \
	  $(BIN)/python recipes/tools/localbuild.py build recipes/powerddl --output-dir $(CONDA_OUT); \
	fi

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
