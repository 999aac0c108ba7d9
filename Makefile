# PowerDDL developer entry points. Every target installs what is missing into .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.powerddl-installed
PYTEST_ARGS ?=

.PHONY: install demo test test-fast bench lint docs clean

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

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
