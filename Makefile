# dschat-book — two commands on a fresh machine:
#   make book   set up .venv, execute every notebook (CPU preset), build HTML into _build/html
#   make test   set up .venv, run the tests (which execute every notebook with papermill)
# Also: make lab (JupyterLab on the notebooks), make bench (benchmarks -> benchmarks/results and
# the appendix; see benchmarks/README.md), make clean.
#
# CUDA users: install the torch build you want first, e.g.
#   make book TORCH_SPEC="torch==2.13.0" TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

PYTHON          ?= python3
VENV            ?= .venv
TORCH_SPEC      ?= torch==2.13.0
TORCH_INDEX_URL ?=
PYTEST_ARGS     ?=
KERNEL_NAME     := dschat-book

VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
SITE      := _build/site
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
EXECUTED  := $(patsubst notebooks/%,$(SITE)/notebooks/%,$(NOTEBOOKS))
# An executed notebook is stale when its source, the library or the shipped data changed.
INPUTS    := $(sort $(wildcard dschat_lib/*.py) $(shell find data -type f 2>/dev/null))

.PHONY: setup book test lab execute clean system-deps bench

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(MAKE) system-deps
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(VPY) -m pip install --quiet -e ".[book,test]"
	@echo "building DeepSpeed's cpu_adam and async_io ops once (cached in ~/.cache/torch_extensions)"
	$(VPY) -c "from dschat_lib.zero import build_ops; build_ops()"
	$(VPY) -m ipykernel install --user --name $(KERNEL_NAME) --display-name "Python (dschat-book)" >/dev/null
	touch $@

# DeepSpeed's async_io op (NVMe offload) compiles against libaio. Installed when we may;
# otherwise only the NVMe offload demo is skipped, with a message saying why.
system-deps:
	@if ! dpkg -s libaio-dev >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing libaio-dev (for DeepSpeed's NVMe offload op)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null) \
	      || echo "warning: could not install libaio-dev; NVMe offload demos will be skipped"; \
	  else echo "note: install libaio-dev (sudo apt-get install libaio-dev) for NVMe offload demos"; fi; \
	fi

$(SITE)/notebooks/%.ipynb: notebooks/%.ipynb $(INPUTS) | $(STAMP)
	$(VPY) tests/harness.py execute $< $@

execute: $(EXECUTED)

book: $(EXECUTED)
	$(VPY) tests/harness.py build-book

test: $(STAMP)
	$(VPY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: that is a failure here"; exit 1; fi; \
	  exit $$rc

# The benchmark suite for this machine (GPU if present, else CPU); ~3 minutes on 2 idle CPU cores.
bench: $(STAMP)
	$(VPY) benchmarks/run.py $(BENCH_ARGS)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf _build
