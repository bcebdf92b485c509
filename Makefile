# Asteroid-Edge developer targets. `make help` lists them.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PYTEST  := $(BIN)/python -m pytest

.PHONY: help install demo test test-slow fuzz lint fmt typecheck bench bench-edge bench-recovery bench-adapt bench-elastic bench-galaxy bench-fl bench-fl-homes bench-async bench-duanwu bench-duanwu-split bench-cli images test-compose test-arm64 deploy deploy-status undeploy check clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-11s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python  ## virtual environment with torch (CPU build) and the project
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[all,dev]'
	# Flower, for the FedAvg cross-check (tests/fl/test_flower.py): its release pins typer
	# below 0.21, for its own CLI only, while we need typer >= 0.29; so it comes without
	# its declared dependencies, plus the four its server and client modules import.
	$(BIN)/pip install --quiet httpx pycryptodome cryptography iterators
	$(BIN)/pip install --quiet --no-deps flwr==1.42.0

demo: install  ## quick start: embedded Redis, the four services and 4 workers train a small CNN
	$(BIN)/asteroid demo

test:  ## the default suite (unit + integration; starts its own Redis if none answers)
	$(PYTEST)

test-slow:  ## only the slow tests
	$(PYTEST) -m slow

FUZZ_EXAMPLES ?= 20000
FUZZ_SECONDS  ?= 600

fuzz:  ## fuzz the wire decoder: hypothesis with many examples, then atheris (extra "fuzz")
	ASTEROID_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PYTEST) -p no:cacheprovider --timeout=0 \
		tests/security/test_fuzz_codec.py
	@$(BIN)/python -c 'import atheris' 2>/dev/null || \
		{ echo "atheris is missing: $(BIN)/pip install -e '.[fuzz]'"; exit 1; }
	$(BIN)/python -m tests.security.fuzz_codec_atheris -max_total_time=$(FUZZ_SECONDS)

lint:  ## ruff lint and format check, import layering (import-linter)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

fmt:  ## format and autofix
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck:  ## mypy strict on common/ and services/
	$(BIN)/mypy

bench:  ## benchmarks: transport (+CURVE), planner speed, simulated planners, heartbeat flood, inbound floods; tables and plots in bench-results/
	$(BIN)/python -m tests.bench.bench_transport --out bench-results/transport
	$(BIN)/python -m tests.bench.bench_planner
	$(BIN)/python -m tests.bench.bench_simulation --out bench-results/simulation
	$(BIN)/python -m tests.bench.bench_flood --out bench-results/flood
	$(BIN)/python -m tests.bench.bench_inbound --out bench-results/inbound

bench-cli:  ## CLI cold start (--version, status, cancel, infer --help) against e500fc9; table in bench-results/cli/
	$(BIN)/python -m tests.bench.bench_cli_start --out bench-results/cli

bench-edge:  ## real training on the emulated edge testbed (root): planners side by side
	$(BIN)/python -m tests.bench.bench_edge --out bench-results/edge --memory-case

bench-recovery:  ## recovery on the edge testbed (root): each device of Env D killed (lightweight, heavy) and SIGSTOPped, kill -> first commit by part; ARGS=--quick
	$(BIN)/python -m tests.bench.bench_recovery --out bench-results/recovery $(ARGS)

bench-adapt:  ## adaptation on the edge testbed (root): a device throttled mid-job, re-partitioned
	$(BIN)/python -m tests.bench.bench_adapt --out bench-results/adapt

bench-elastic:  ## join and drain on the edge testbed (root), against fresh 4- and 3-device plans
	$(BIN)/python -m tests.bench.bench_elastic --out bench-results/elastic

.PHONY: chaos
chaos:  ## a seeded chaos run on the edge testbed (root): 25 membership events on one job, invariants, event table and plot (bench-results/chaos)
	$(BIN)/python -m tests.chaos.run --backend testbed --seed 28 --events 25 --devices 4 --need 2 --per-event 3 --out bench-results/chaos

bench-galaxy:  ## Galaxy serving on the edge testbed (root): galaxy, megatron, sp, local; links swept
	$(BIN)/python -m tests.bench.bench_galaxy --out bench-results/galaxy

bench-fl:  ## Eco-FL, FedAvg, FedAsync, FedAT, Astraea on the virtual-clock FL simulator (digits, non-IID)
	$(BIN)/python -m tests.bench.bench_fl --out bench-results/fl

.PHONY: gpu-check
gpu-check:  ## on a machine with a CUDA GPU: the cuda-marked tests, then its profile, plan and samples/s against the CPU (bench-results/gpu/)
	$(BIN)/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu-check: torch sees no CUDA device (torch " + torch.__version__ + ")")'
	$(PYTEST) -p no:cacheprovider -m cuda -rs tests/worker/test_cuda_stage.py tests/integration/test_cuda_mixed.py tests/galaxy/test_cuda_blocks.py tests/galaxy/test_llama.py
	$(BIN)/python -m tests.bench.gpu_check --out bench-results/gpu

bench-fl-homes:  ## Eco-FL, FedAvg, FedAsync, FedAT, Astraea with real homes on the edge testbed (root)
	$(BIN)/python -m tests.bench.bench_fl_homes --out bench-results/fl-homes

bench-async:  ## async (no drain) against sync on the edge testbed (root): M 4/16/64 (light layers), 4/16 (heavy CIFAR-size layers; mobilenet_v2 on balanced stages) with the predicted gain, a throttled heterogeneous pipeline with the dynamic partition, accuracy against wall clock
	$(BIN)/python -m tests.bench.bench_async --out bench-results/async

bench-duanwu:  ## Duan & Wu's planner: Algorithm 2 vs brute-force grouping, beta split vs plain pipelining (predicted)
	$(BIN)/python -m tests.bench.bench_duanwu --out bench-results/duanwu

bench-duanwu-split:  ## Duan & Wu's split measured (root): its gain on one and two cores and per device, the planner's decision, depth-4 epochs on 2-core testbed devices
	$(BIN)/python -m tests.bench.bench_duanwu_split --out bench-results/duanwu-split $(ARGS)

ARCH ?= amd64

images:  ## container images (worker, control, redis) from Debian packages and a wheelhouse; ARCH=amd64
	PYTHON=$(BIN)/python deploy/images/build.sh --arch $(ARCH)

ARM64_WORKER = asteroid-edge/worker:$$($(BIN)/python -c 'from common.version import VERSION; print(VERSION.replace("+", "-"))')-arm64

test-arm64:  ## an arm64 worker container (qemu) beside amd64 workers trains exactly; builds the arm64 images if missing
	@docker image inspect $(ARM64_WORKER) >/dev/null 2>&1 || $(MAKE) images ARCH=arm64
	$(PYTEST) -p no:cacheprovider -m slow tests/integration/test_mixed_arch.py

test-compose:  ## the docker-compose tests: deploy/compose.yaml trains, exports, survives a killed worker
	$(PYTEST) -p no:cacheprovider -m integration tests/compose

INVENTORY ?= deploy/devices.yaml
KEYS      ?= keys

deploy:  ## the cluster on the INVENTORY's devices over ssh (KEYS: key set); changes only what differs
	$(BIN)/asteroid deploy up --inventory $(INVENTORY) --keys $(KEYS)

deploy-status:  ## each deployed device's services: state, health, image version
	$(BIN)/asteroid deploy status --inventory $(INVENTORY) --keys $(KEYS)

undeploy:  ## remove the cluster's containers, files and shipped images from its devices
	$(BIN)/asteroid deploy down --inventory $(INVENTORY) --keys $(KEYS)

check: lint typecheck test  ## every check, in order

clean:  ## remove caches and results
	rm -rf bench-results .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
