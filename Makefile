PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Every install uses the exact versions tested together; pyproject.toml itself declares ranges.
PIP := $(BIN)/pip install -q -c constraints.txt
# torchtitan 0.3.0's own requirements, installed after it (it goes in with --no-deps, see install below);
# its model package imports triton even on a machine without a GPU.
TORCHTITAN_DEPS := spmd_types tyro docstring_parser tensorboard torchdata einops triton

.PHONY: install test test-slow demo docs package-check test-min test-compat bench bench-quick unit clean

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(PIP) torch
	# deepspeed builds from source: DS_BUILD_OPS=0 skips its C++/CUDA ops (the tests need none).
	DS_BUILD_OPS=0 $(PIP) -e '.[dev,deepspeed]'
	# --no-deps: megatron-core's torch requirement can pull a CUDA torch, and torchtitan's datasets<4.8
	# caps fsspec below the tested version. torchtitan's other requirements follow.
	$(PIP) --no-deps megatron-core torchtitan
	$(PIP) $(TORCHTITAN_DEPS)
	touch $@

install: $(BIN)/.installed

test: install
	$(BIN)/python -m pytest -q tests

# The long multi-process and framework cases the default suite leaves out (marked slow); CI runs them too.
test-slow: install
	$(BIN)/python -m pytest -q -m slow tests

unit: install
	$(BIN)/python -m pytest -q tests/unit tests/storage

demo: install
	$(BIN)/python examples/demo.py
	$(BIN)/python examples/elastic_demo.py --out demo_out/elastic

# The documentation site, built in strict mode (any warning fails it), then its links checked.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site
	$(BIN)/python tools/check_links.py build/site

# Builds the wheel and sdist and installs them into fresh venvs beside torch (see tools/package_check.sh).
package-check: install
	PY=$(PY) BUILD_PY=$(BIN)/python tools/package_check.sh

# The lowest tested version of every requirement (constraints-min.txt: torch 2.6.0, a CUDA build from the
# package index that runs on CPU) with the test tools. Rebuilt only when a constraints file changes: a
# workspace that keeps build/ reuses it, and pip's own cache serves the downloads to a rebuild.
MIN_VENV := build/test-min
$(MIN_VENV)/.installed: constraints-min.txt constraints.txt
	rm -rf $(MIN_VENV) && $(PY) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/pip install -q -c constraints-min.txt torch numpy xxhash fsspec psutil rich tqdm \
	  safetensors boto3 botocore matplotlib \
	  $$(grep -E '^(pytest|pytest-timeout|hypothesis|expecttest|moto)==' constraints.txt | sed 's/^moto==/moto[server]==/')
	touch $@

# The multi-process cases test-min runs on the lowest versions: FSDP2, DDP, TP, 2-D and HSDP saves loaded
# into every other layout (FSDP2 into TP among them), asynchronous eager and lazy saves, the torn-snapshot
# guard, and the manager on 4 ranks.
MIN_DIST := tests/dist/test_matrix.py::test_reshard_matrix tests/dist/test_async.py tests/dist/test_guard.py \
  tests/dist/test_manager.py

# The unit, storage and golden tests and the multi-process subset above, on the lowest tested versions.
test-min: $(MIN_VENV)/.installed
	$(MIN_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/unit tests/storage tests/golden \
	  --ignore=tests/unit/test_deepspeed_geometry.py --ignore=tests/unit/test_export_hf_config.py
	$(MIN_VENV)/bin/python -m pytest -q -p no:cacheprovider -m 'slow or not slow' $(MIN_DIST)

# The framework integrations on the lowest tested torch: Lightning, Accelerate, transformers, DeepSpeed,
# Megatron-Core and torchtitan at constraints-frameworks-min.txt's versions, in a venv layered over
# test-min's. It reads test-min's torch 2.6 through a .pth file instead of installing it again (5.7 GB), so
# its own packages come first on the path and test-min's are left as they are.
COMPAT_VENV := build/test-compat
PURELIB := -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
$(COMPAT_VENV)/.installed: $(MIN_VENV)/.installed constraints-frameworks-min.txt
	rm -rf $(COMPAT_VENV) && $(PY) -m venv $(COMPAT_VENV)
	echo "import site; site.addsitedir('$$($(MIN_VENV)/bin/python $(PURELIB))')" \
	  > "$$($(COMPAT_VENV)/bin/python $(PURELIB))/test-min.pth"
	DS_BUILD_OPS=0 $(COMPAT_VENV)/bin/pip install -q -c constraints-frameworks-min.txt lightning accelerate \
	  transformers deepspeed
	$(COMPAT_VENV)/bin/pip install -q -c constraints-frameworks-min.txt --no-deps megatron-core torchtitan
	$(COMPAT_VENV)/bin/pip install -q -c constraints-frameworks-min.txt $(filter-out triton,$(TORCHTITAN_DEPS))
	# torch must come from test-min's venv, not a second copy here
	$(COMPAT_VENV)/bin/python -c 'import sys, torch; assert sys.prefix not in torch.__file__, torch.__file__'
	touch $@

# The framework tests on torch 2.6, the slow cases included: tests/clients (Lightning, Accelerate and the HF
# Trainer on one and two processes, Lightning and the Trainer under FSDP too; torchtitan's check that it
# names the torch it needs) and the DeepSpeed ZeRO and Megatron-Core TP x PP multi-process tests. Their MoE
# variants were measured once (docs/compatibility.md) and stay out, to keep CI short.
COMPAT_TESTS := tests/clients tests/dist/test_deepspeed.py tests/dist/test_megatron.py

test-compat: $(COMPAT_VENV)/.installed
	DS_ACCELERATOR=cpu $(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider -m 'slow or not slow' $(COMPAT_TESTS)

# The benchmarks' own extra: matplotlib for the plots, and ByteCheckpoint 0.0.2 as a peer. ByteCheckpoint
# goes in with --no-deps (its metadata pins torch<=2.5); its runtime dependencies are the 'bench' extra plus
# the grpcio and protobuf it was built against, installed without constraints.txt because they are older
# than the tested set's.
$(BIN)/.bench-installed: $(BIN)/.installed
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '.[bench]' grpcio==1.69.0 protobuf==3.20.3
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
	rm -rf $(VENV) build site *.egg-info
