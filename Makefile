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

bench: install
	$(BIN)/python bench/bench_sync.py
	$(BIN)/python bench/bench_async.py
	$(BIN)/python bench/bench_load.py
	$(BIN)/python bench/scale_sim.py

bench-quick: install
	$(BIN)/python bench/bench_sync.py --quick
	$(BIN)/python bench/bench_async.py --quick
	$(BIN)/python bench/bench_load.py --quick
	$(BIN)/python bench/scale_sim.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
