#!/usr/bin/env bash
# The device checks for a task that has a GPU machine (never run by CI).
#
# For the workplace's H200 machines (Python 3.12 with a CUDA build of torch,
# numpy, uvloop, xxhash, aiofiles, click, rich, pytest, hypothesis,
# pytest-timeout, cupy and the CUDA toolkit already there; no network).
#
# Once, on the development machine, in the repository root (.whl/ and
# .gpu_old/ are ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pytest-asyncio kvikio-cu13 libkvikio-cu13 'rapids-logger==0.3.*'
#   # optional: the code before a change, to show its GPU tests fail there
#   mkdir -p .gpu_old && git archive REV engine io | tar -x -C .gpu_old
# Then one device call (about 5 minutes):
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".gpu_old"], timeout_s=540)
# What comes back under $OUT: gpu.log (everything printed), bench-gpu.json
# (the default `kvtier bench`), bench-gpu-posix.json, bench-gpu-deepseek-v3.json.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-$(mktemp -d)}
# A dry run anywhere (tiny benches): GPU_CHECK_SIZE=64M bash benchmarks/gpu_check.sh
SIZE=(${GPU_CHECK_SIZE:+--size "$GPU_CHECK_SIZE"})
start=$SECONDS
step() { echo; echo "== [$((SECONDS - start)) s] $*"; }

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
# kvtier from a source tree without an install: engine/ is the package, io/ its io.
tree() {
    mkdir -p "$1/kvtier"
    ln -sf "$2"/engine/*.py "$1/kvtier/"
    ln -sfn "$2/io" "$1/kvtier/io"
}
tree /tmp/kv "$PWD"
export PYTHONPATH=/tmp/kv:/tmp/site
PYTEST=(python3 -m pytest -q -p no:cacheprovider -W default --timeout 90)

main() {
step "machine"
nvidia-smi -L
df -h . /tmp | cat
python3 - <<'EOF'
import torch, kvtier
print("torch", torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(), "cuda", torch.version.cuda)
from kvtier.io._rowio import kvikio_available
print("kvikio usable:", kvikio_available())
try:
    import kvikio, kvikio.defaults as d
    print("kvikio", kvikio.__version__)
    for name in ("compat_mode", "num_threads", "task_size", "gds_threshold"):
        try:
            print(" ", name, d.get(name))
        except Exception as exc:
            print(" ", name, "?", exc)
    try:
        import kvikio.cufile_driver as drv
        print("  cufile driver properties:", drv.DriverProperties().is_gds_available)
    except Exception as exc:
        print("  cufile driver:", exc)
except Exception as exc:
    print("kvikio import failed:", exc)
EOF

step "GPU tests: CUDA path, caller streams, NVMe tier on CUDA, RowIO conformance (kvikio too)"
timeout 170 "${PYTEST[@]}" -rs tests/engine/test_gpu.py tests/engine/test_gpu_streams.py \
    tests/engine/test_gpu_nvme.py tests/io/test_rowio.py

if [ -d .gpu_old/engine ]; then
    step "the stream tests on the code before the change (expected to FAIL there)"
    tree /tmp/kvold "$PWD/.gpu_old"
    PYTHONPATH=/tmp/kvold:/tmp/site timeout 60 "${PYTEST[@]}" tests/engine/test_gpu_streams.py \
        -k "waits_for or calling_threads"
fi

step "kvtier bench, embedded defaults (io backend auto: kvikio where it loads)"
timeout 150 python3 -m kvtier.cli bench "${SIZE[@]}" --json "$OUT/bench-gpu.json"

step "kvtier bench --io-backend posix (kvtier's own O_DIRECT threads), one pass"
timeout 75 python3 -m kvtier.cli bench "${SIZE[@]}" --repeat 1 --io-backend posix \
    --json "$OUT/bench-gpu-posix.json"

# Many layers per group: the CUDA path issues an index_select and a
# _foreach_copy_ per layer piece and job on the event loop thread. Is a
# store launch-bound on a real GPU?
step "kvtier bench --layout deepseek-v3 --no-nvme, one pass"
timeout 50 python3 -m kvtier.cli bench --layout deepseek-v3 --no-nvme --repeat 1 "${SIZE[@]}" \
    --json "$OUT/bench-gpu-deepseek-v3.json"
step "done"
}
main 2>&1 | tee "$OUT/gpu.log"
