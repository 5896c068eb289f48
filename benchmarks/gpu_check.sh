#!/usr/bin/env bash
# The device checks for a task that has a GPU machine (never run by CI).
#
# Prepared for the workplace's H200 machines (Python 3.12 with a CUDA build of
# torch, numpy, uvloop, xxhash, aiofiles, click, rich, pytest, hypothesis,
# pytest-timeout, cupy and the CUDA toolkit already there; no network). Not yet
# run on one: expect to fix the first run.
#
# Once, on the development machine, in the repository root (.whl/ is ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pytest-asyncio kvikio-cu13 libkvikio-cu13 'rapids-logger==0.3.*'
# Then one device call (about 6 minutes):
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=590)
# What comes back under $OUT: pytest-gpu.log, bench.log, bench-gpu.json,
# bench-posix.log, bench-gpu-posix.json, bench-deepseek-v3.log,
# bench-gpu-deepseek-v3.json.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-$(mktemp -d)}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
# kvtier from this tree without an install: engine/ is the package, io/ its io.
mkdir -p /tmp/kv/kvtier
ln -sf "$PWD"/engine/*.py /tmp/kv/kvtier/
ln -sfn "$PWD/io" /tmp/kv/kvtier/io
export PYTHONPATH=/tmp/kv:${PYTHONPATH:-}

nvidia-smi -L
python3 -c "import torch, kvtier; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 -c "from kvtier.io._rowio import kvikio_available; print('kvikio usable:', kvikio_available())"

# The CUDA path and the RowIO conformance suite on every backend (kvikio included).
# -W default: a new warning of that torch or cupy should not fail the first run.
timeout 180 python3 -m pytest -q -p no:cacheprovider -W default \
    tests/engine/test_gpu.py tests/io/test_rowio.py 2>&1 | tee "$OUT/pytest-gpu.log"

# The main job on real device buffers, kvikio where it loads.
timeout 200 python3 -m kvtier.cli bench --size 1G --repeat 3 --dir /tmp \
    --json "$OUT/bench-gpu.json" 2>&1 | tee "$OUT/bench.log"

# The same with kvtier's own O_DIRECT threads instead of kvikio's host path.
timeout 100 python3 -m kvtier.cli bench --size 1G --repeat 1 --dir /tmp --io-backend posix \
    --json "$OUT/bench-gpu-posix.json" 2>&1 | tee "$OUT/bench-posix.log"

# Many layers per group: the CUDA path issues an index_select and a
# _foreach_copy_ per layer piece and job, and one copy per chunk and piece, on
# the event loop thread (benchmarks/torch_path.py: 164 us per chunk on CPU
# tensors for deepseek-v3's 61 layers). Is a store launch-bound on a real GPU?
timeout 90 python3 -m kvtier.cli bench --layout deepseek-v3 --no-nvme --size 1G --repeat 1 \
    --json "$OUT/bench-gpu-deepseek-v3.json" 2>&1 | tee "$OUT/bench-deepseek-v3.log"
