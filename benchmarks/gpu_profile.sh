#!/usr/bin/env bash
# A profile of the CUDA copy path and the engine tests on the device's torch
# (never run by CI). Same set-up as gpu_check.sh (carry .whl):
#   run(command="bash benchmarks/gpu_profile.sh", carry=[".whl"], timeout_s=300)
# Back under $OUT: profile.log (cProfile of `kvtier bench --no-nvme`, top
# functions by own time), pytest-engine.log (tests/engine on that torch).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-$(mktemp -d)}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
mkdir -p /tmp/kv/kvtier
ln -sf "$PWD"/engine/*.py /tmp/kv/kvtier/
ln -sfn "$PWD/io" /tmp/kv/kvtier/io
export PYTHONPATH=/tmp/kv:/tmp/site
{
    timeout 90 python3 -m cProfile -o /tmp/prof.out -m kvtier.cli bench --no-nvme \
        --size 512M --repeat 1 ${GPU_PROFILE_ARGS:-}
    python3 - <<'PY'
import pstats
stats = pstats.Stats("/tmp/prof.out")
stats.sort_stats("tottime").print_stats(35)
stats.sort_stats("cumulative").print_stats("_transfer|_engine", 25)
PY
} 2>&1 | tee "$OUT/profile.log"
timeout 180 python3 -m pytest -q -p no:cacheprovider -W default --timeout 120 tests/engine \
    2>&1 | tail -40 | tee "$OUT/pytest-engine.log"
