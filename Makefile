# PowerDDL developer entry points. Every target installs what is missing into .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.powerddl-installed
PYTEST_ARGS ?=

.PHONY: install demo demo-tf test test-fast bench lint docs conda docker clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[torch,mpi,tensorflow,examples,perf,clients,dev]'
	@touch $@

install: $(STAMP)

demo: install
	$(BIN)/python examples/demo.py 1,2

# Keras 3 model.fit on scikit-learn's digits, 2 ranks through ddlrun (ddl.keras)
demo-tf: install
	$(BIN)/ddlrun -n 2 $(BIN)/python examples/keras_digits.py

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: install
	$(BIN)/ddl-perf allreduce --ranks 2,4 -b 1K -e 64M -f 4 --compare ddl,ddl-heap,gloo,mpi

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/deptry .

docs: install
	$(BIN)/ddl-perf env --markdown > .env-table.md
	$(BIN)/python -c "import re,sys; p='docs/tuning.md'; s=open(p).read(); t=open('.env-table.md').read().rstrip(); a=s.index('| variable | default |'); b=s.index('\n\n', a); open(p,'w').write(s[:a]+t+s[b:])"
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

# Container images powerddl:<variant>-<version> (docker/Dockerfile.<variant>) with docker,
# podman or buildah, whichever is found first. DOCKER_BUILD_ARGS passes more, e.g.
#   make docker DOCKER_VARIANTS=cpu DOCKER_BUILD_ARGS="--build-arg BASE_IMAGE=my/bookworm"
DOCKER_VARIANTS   ?= cpu cuda
DOCKER_REPO       ?= powerddl
DOCKER_BUILD_ARGS ?=
DDL_VERSION       := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)

docker:
	@if command -v docker >/dev/null 2>&1; then build="docker build"; \
	elif command -v podman >/dev/null 2>&1; then build="podman build --format docker"; \
	elif command -v buildah >/dev/null 2>&1; then build="buildah bud --format docker"; \
	else echo "make docker: needs docker, podman or buildah on PATH" >&2; exit 1; fi; \
	for variant in $(DOCKER_VARIANTS); do \
	  echo "make docker: $$build -f docker/Dockerfile.$$variant -t $(DOCKER_REPO):$$variant-$(DDL_VERSION)"; \
	  $$build -f docker/Dockerfile.$$variant --build-arg DDL_VERSION=$(DDL_VERSION) \
	    $(DOCKER_BUILD_ARGS) -t $(DOCKER_REPO):$$variant-$(DDL_VERSION) -t $(DOCKER_REPO):$$variant . || exit 1; \
	done

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
