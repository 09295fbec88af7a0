# Two commands from a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kiln-installed
DEMO_DATA ?= demo-data
CONFIG ?= configs/tiny.yaml

.PHONY: install system-packages stack demo demo-compare test test-fast lint format benchmark gpu-wheels \
	gpu-check clean

# Create the venv if missing and install the project with the pinned constraints.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kiln demo-data $(DEMO_DATA) --n 400
	$(BIN)/kiln run --config $(CONFIG) --source $(DEMO_DATA)

# After `make demo`: a second model, the tiny preset stopped early (configs/tiny-short.yaml), its
# study on the same prompts, and a blind A/B comparison of the demo's model (A) with it (B).
# Prints the rating links and the admin link, then serves the rating app until Ctrl-C; the last
# lines say how to read the result.
# RATE_PORT: the app's port (default: the config's human_eval.port); GOLD: attention checks per
# rater (default: the config's human_eval.gold_per_rater).
RATERS ?= 1
demo-compare: $(STAMP)
	$(BIN)/kiln train --config configs/tiny-short.yaml
	@set -e; \
	short=$$($(BIN)/kiln evaluate --config configs/tiny-short.yaml \
		| $(BIN)/python -c 'import json, sys; print(json.load(sys.stdin)["study_id"])'); \
	cid=$$($(BIN)/kiln compare --config $(CONFIG) --a models:/kiln-t2i@candidate --b $$short \
		--raters-per-pair $(RATERS) $(if $(GOLD),--gold $(GOLD))); \
	echo; echo "Blind comparison $$cid: the demo's model against the one trained a tenth as long."; \
	echo "Rating links (one per rater; the app serves them below):"; \
	$(BIN)/kiln rate invite --config $(CONFIG) --comparison $$cid --raters $(RATERS) \
		$(if $(RATE_PORT),--port $(RATE_PORT)); \
	echo "Admin page (the running result; a new link each time this target runs):"; \
	$(BIN)/kiln rate admin-link --config $(CONFIG) --rotate $(if $(RATE_PORT),--port $(RATE_PORT)); \
	echo "Vote on about 30 pairs (keys 1, 2, 3 and Enter), then in another terminal:"; \
	echo "  $(BIN)/kiln rate report --config $(CONFIG) --comparison $$cid"; \
	echo "and open kiln-data/human_eval/$$cid/preference.png. Ctrl-C stops the app."; \
	$(BIN)/kiln rate serve --config $(CONFIG) $(if $(RATE_PORT),--port $(RATE_PORT))

# A team's services on this machine (docs/operations.md, "Running Kiln for a team"): PostgreSQL,
# an S3 stand-in, the Prefect server with an auth string and a worker, MLflow with logins and
# the rating app. Their data and secrets stay in STACK_DIR; Ctrl-C stops them all.
STACK_DIR ?= stack
stack: $(STAMP) system-packages
	$(BIN)/kiln stack --dir $(STACK_DIR)

# Debian packages the tests use, installed when missing, where apt-get exists: Chromium for the
# rating app's browser test (Playwright's own browser download needs the network), SLURM with
# munge for the two-node cluster the multi-node tests start on loopback, and PostgreSQL for
# the private server the ratings store's tests start.
CHROMIUM ?= /usr/bin/chromium
system-packages:
	@missing=""; \
	[ -x $(CHROMIUM) ] || missing="$$missing chromium"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	for b in slurmd slurmctld sbatch munged; do command -v $$b >/dev/null 2>&1 || \
		PATH="$$PATH:/usr/sbin" command -v $$b >/dev/null 2>&1 || { \
		missing="$$missing slurmd slurmctld slurm-client munge"; break; }; done; \
	if [ -z "$$missing" ]; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
		echo "Installing Debian's$$missing (browser and SLURM tests)"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q $$missing; \
	else \
		echo "make test needs$$missing (no apt-get here): install them with your package manager" >&2; \
		exit 1; \
	fi

# The test files run on one worker per core (pytest-xdist; a file's tests stay on one worker,
# so a module's fixtures are built once). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= auto
test: $(STAMP) system-packages
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --cpu-top 30

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not e2e and not integration"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

benchmark: $(STAMP)
	$(BIN)/python benchmarks/demo_walltime.py --out benchmarks/results/demo_walltime.json
	$(BIN)/python benchmarks/ingest.py --out benchmarks/results/ingest.json
	$(BIN)/python benchmarks/loader.py --out benchmarks/results/loader.json
	$(BIN)/python benchmarks/train_throughput.py --out benchmarks/results/train_throughput_cpu.json --steps 12
	$(BIN)/python benchmarks/multinode.py --out benchmarks/results/multinode.json
	$(BIN)/python benchmarks/catalog_scale.py --out benchmarks/results/catalog_scale.json --dask-sizes 100000,1000000

# The wheels the GPU check carries to the device machine (Python 3.12, no network), listed in
# benchmarks/gpu_wheels.txt, into .whl/ (git-ignored). Fails when they and the working tree
# would exceed the device tool's 64 MiB carry limit, less GPU_CARRY_SPARE_MIB for files the
# tree gains. docs/benchmarks.md ("GPU check") has the device command that installs them.
GPU_WHEEL_DIR ?= .whl
GPU_CARRY_SPARE_MIB ?= 4
GPU_PLATFORMS := $(foreach n,5 12 14 17 24 27 28 31 34 35 39,--platform manylinux_2_$(n)_x86_64) \
	--platform manylinux2014_x86_64 --platform manylinux1_x86_64
gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEEL_DIR)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(GPU_PLATFORMS) -d $(GPU_WHEEL_DIR) -r benchmarks/gpu_wheels.txt
	@wheels=$$(du -cb $(GPU_WHEEL_DIR)/*.whl | tail -1 | cut -f1); \
	tree=$$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1); \
	limit=$$(( (64 - $(GPU_CARRY_SPARE_MIB)) * 1024 * 1024 )); \
	echo "wheels $$wheels bytes + working tree $$tree bytes = $$((wheels + tree)) of $$limit"; \
	if [ $$((wheels + tree)) -gt $$limit ]; then \
		echo "gpu-wheels: over the carry budget of $$limit bytes (64 MiB less" \
			"GPU_CARRY_SPARE_MIB=$(GPU_CARRY_SPARE_MIB)); trim benchmarks/gpu_wheels.txt" >&2; \
		exit 1; \
	fi

# The GPU check (benchmarks/gpu_check.py): on CUDA the full run, else its toy CPU path.
# GPU_CHECK_PY: the interpreter (the device machine's python3, with the carried wheels on
# PYTHONPATH); OUT: where gpu_check.json goes.
GPU_CHECK_PY ?= $(BIN)/python
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_CHECK_PY) benchmarks/gpu_check.py \
		$(if $(OUT),--out $(OUT)) $(GPU_CHECK_ARGS)

clean:
	rm -rf kiln-data $(DEMO_DATA) .pytest_cache
