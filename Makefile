# PowerDDL developer entry points. Every target installs what is missing into .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.powerddl-installed
PYTEST_ARGS ?=

.PHONY: install demo demo-tf test test-fast bench gpu-check matrix lint docs conda docker clean

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

# The GPU path in one run, a report in gpu-check/ (docs/gpu-check.md); without a GPU: one line
gpu-check: install
	$(BIN)/ddl-perf gpu-check --out gpu-check

# The core, torch and TensorFlow tests on the oldest and the newest release of the supported
# range (pyproject.toml's [tool.powerddl.supported]), each in .venv-matrix/<end>; prints the
# table docs/install.md shows. MATRIX_PYTEST_ARGS= (empty) runs the slow tests too.
MATRIX_PYTEST_ARGS ?= -m "not slow"

matrix:
	$(PYTHON) tools/matrix.py --pytest-args '$(MATRIX_PYTEST_ARGS)'

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/deptry .

docs: install
	$(BIN)/ddl-perf env --markdown > .env-table.md
	$(BIN)/python -c "import re,sys; p='docs/tuning.md'; s=open(p).read(); t=open('.env-table.md').read().rstrip(); a=s.index('| variable | default |'); b=s.index('\n\n', a); open(p,'w').write(s[:a]+t+s[b:])"
	@rm -f .env-table.md
	$(BIN)/python -m pytest -q tests/core/test_docs.py

# conda packages into $(CONDA_OUT) (a local channel, indexed), built and tested by the real
# rattler-build (py-rattler-build, in the dev extra) from recipes/powerddl/recipe.yaml. Offline:
# its build and test environments are solved from $(CONDA_LOCAL), a channel made of PyPI wheels
# and a stub python by recipes/tools/local_channel.py (docs/install.md: what is substituted).
CONDA_OUT   ?= build/conda-bld
CONDA_LOCAL ?= build/conda-local

conda: install
	$(BIN)/python recipes/tools/build.py recipes/powerddl --output-dir $(CONDA_OUT) \
	  --channel $(CONDA_LOCAL)

# Container images powerddl:<variant>-<version> with docker, podman or buildah, whichever is
# found first: cpu (docker/Dockerfile.cpu), cuda (docker/Dockerfile.cuda, PyTorch) and cuda-tf
# (the same file, FRAMEWORK=tensorflow). DOCKER_BUILD_ARGS passes more, e.g.
#   make docker DOCKER_VARIANTS=cpu DOCKER_BUILD_ARGS="--build-arg BASE_IMAGE=my/bookworm"
DOCKER_VARIANTS   ?= cpu cuda cuda-tf
DOCKER_REPO       ?= powerddl
DOCKER_BUILD_ARGS ?=
DDL_VERSION       := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)

docker:
	@if command -v docker >/dev/null 2>&1; then build="docker build"; \
	elif command -v podman >/dev/null 2>&1; then build="podman build --format docker"; \
	elif command -v buildah >/dev/null 2>&1; then build="buildah bud --format docker"; \
	else echo "make docker: needs docker, podman or buildah on PATH" >&2; exit 1; fi; \
	for variant in $(DOCKER_VARIANTS); do \
	  case $$variant in \
	    cpu) file=docker/Dockerfile.cpu; arg= ;; \
	    cuda) file=docker/Dockerfile.cuda; arg="--build-arg FRAMEWORK=torch" ;; \
	    cuda-tf) file=docker/Dockerfile.cuda; arg="--build-arg FRAMEWORK=tensorflow" ;; \
	    *) echo "make docker: unknown variant $$variant (cpu, cuda, cuda-tf)" >&2; exit 2 ;; \
	  esac; \
	  echo "make docker: $$build -f $$file $$arg -t $(DOCKER_REPO):$$variant-$(DDL_VERSION)"; \
	  $$build -f $$file $$arg --build-arg DDL_VERSION=$(DDL_VERSION) \
	    $(DOCKER_BUILD_ARGS) -t $(DOCKER_REPO):$$variant-$(DDL_VERSION) -t $(DOCKER_REPO):$$variant . || exit 1; \
	done

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
