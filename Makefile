PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test demo bench bench-quick unit clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	# deepspeed builds from source: DS_BUILD_OPS=0 skips its C++/CUDA ops (the tests need none).
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '.[test,s3,tools,deepspeed]'
	# megatron-core with --no-deps: resolving its torch>=2.6 requirement can pull a CUDA torch from PyPI.
	$(BIN)/pip install -q --no-deps megatron-core==0.16.1
	touch $@

install: $(BIN)/.installed

test: install
	$(BIN)/python -m pytest -q tests

unit: install
	$(BIN)/python -m pytest -q tests/unit tests/storage

demo: install
	$(BIN)/python examples/demo.py
	$(BIN)/python examples/elastic_demo.py --out demo_out/elastic

# The benchmarks' own extra: matplotlib for the plots, and ByteCheckpoint 0.0.2 as a peer. ByteCheckpoint
# goes in with --no-deps (its metadata pins torch<=2.5); its runtime dependencies are the 'bench' extra.
$(BIN)/.bench-installed: $(BIN)/.installed
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '.[bench]'
	$(BIN)/pip install -q --no-deps bytecheckpoint==0.0.2
	touch $@

# bench/suite.py takes the shared benchmark lock around each piece it runs (see docs/benchmarks.md).
bench: install $(BIN)/.bench-installed
	$(BIN)/python bench/suite.py
	$(BIN)/python bench/scale_sim.py

bench-quick: install $(BIN)/.bench-installed
	$(BIN)/python bench/suite.py --quick
	$(BIN)/python bench/scale_sim.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
