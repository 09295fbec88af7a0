# Two commands from a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kiln-installed
DEMO_DATA ?= demo-data
CONFIG ?= configs/tiny.yaml
# The DrawBench prompts: a copy beside the checkout when there is one (this team's CI has
# ../shared); otherwise Kiln fetches them once from the Hugging Face Hub (tasks/prompts.py).
KILN_DRAWBENCH_CSV ?= $(wildcard $(abspath ../shared/data/drawbench.csv))
export KILN_DRAWBENCH_CSV

.PHONY: install chromium demo test test-fast lint format benchmark clean

# Create the venv if missing and install the project with the pinned constraints.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kiln demo-data $(DEMO_DATA) --n 60
	$(BIN)/kiln run --config $(CONFIG) --source $(DEMO_DATA)

# The rating app's browser test drives Debian's Chromium through Playwright (Playwright's own
# browser download needs the network). Installed here when missing, where apt-get exists.
CHROMIUM ?= /usr/bin/chromium
chromium:
	@if [ -x $(CHROMIUM) ]; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
		echo "Installing Debian's chromium (for tests/human_eval/test_browser.py)"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; \
	else \
		echo "make test needs Chromium at $(CHROMIUM) for tests/human_eval/test_browser.py;" \
			"no apt-get here: install Chromium with your package manager" >&2; \
		exit 1; \
	fi

# The test files run on one worker per core (pytest-xdist; a file's tests stay on one worker,
# so a module's fixtures are built once). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= auto
test: $(STAMP) chromium
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

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

clean:
	rm -rf kiln-data $(DEMO_DATA) .pytest_cache
