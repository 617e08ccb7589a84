#!/usr/bin/env bash
# Run HERE (the CPU machine, repo root, code committed) before the one GPU call: fills .gpu/ (git-ignored), which the
# device call carries (`run` with carry [".gpu"]). See docs/gpu-check.md.
#   .gpu/tokenizer/  the embedded SmolLM2 tokenizer's files (benchmarks/gpu.py --tokenizer; ~3.4 MB, no weights)
#   .gpu/COMMIT      the commit the check measures (the device's copy of the tree may have no git history)
#   .gpu/wheels/     only with --wheels: cp312 wheels of marft_lg's pure-Python needs the image lacks, pinned to this
#                    venv's versions (the GPU tests and gpu.py need none of them; the math-team/demo runs do)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .gpu/tokenizer
if [ -n "$(git status --porcelain -- marft_lg benchmarks tests)" ]; then
  echo "gpu_prepare: uncommitted changes under marft_lg/ benchmarks/ tests/: commit first, the check records HEAD" >&2
  exit 1
fi
git rev-parse HEAD > .gpu/COMMIT
"$PY" - <<'PYEOF'
import shutil
from pathlib import Path

from marft_lg.serving.engine.models import embedded_tokenizer_dir

src = embedded_tokenizer_dir()
for f in src.iterdir():
    if f.is_file():
        shutil.copy2(f, Path(".gpu/tokenizer") / f.name)
print("tokenizer:", sorted(p.name for p in Path(".gpu/tokenizer").iterdir()))
PYEOF
if [ "${1:-}" = "--wheels" ]; then
  # the list in /work/shared/gpu/README.md (what a bare H100 image lacked for the math-team run)
  names="gguf orjson msgspec platformdirs opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
    pydantic pydantic_core annotated-types typing-inspection langchain-core langchain-protocol langsmith langgraph
    langgraph-checkpoint langgraph-prebuilt langgraph-sdk jsonpatch jsonpointer tenacity ormsgpack zstandard uuid_utils
    requests-toolbelt sniffio distro httpx2 httpcore2 truststore websockets"
  mkdir -p .gpu/wheels
  pins=$("$PY" - $names <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version

out = []
for name in sys.argv[1:]:
    try:
        out.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(f"gpu_prepare: {name} is not in this venv, skipped", file=sys.stderr)
print(" ".join(out))
PYEOF
)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .gpu/wheels $pins
fi
du -sh .gpu
