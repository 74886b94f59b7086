#!/usr/bin/env bash
# The device check of a GPU machine, in one run of at most 7 minutes:
# installs what the machine lacks from the wheels in .whl/, runs the tests
# marked cuda and the bench's GPU rows, and writes into OUTDIR
#   gpu_check.log         every step's output, its exit status and seconds
#   summary.txt           one line per step, the pytest summary line, the device
#   bench-cuda.json       trainer and workers on the GPU (multiprocess, shared,
#                         --compare cuda-ipc; 1, 64 and 1024 MiB; 4 workers)
#   bench-cuda-small.json the fixed cost of a send on the GPU: 1 MiB to 4 workers
#                         and 64 KiB to 1 worker, blocking send() (as the README's
#                         trainer calls it), 30 sends each (multiprocess, shared,
#                         --compare cuda-ipc)
#   bench-cuda-1.json     the same, one worker, 64 MiB (multiprocess, cuda-ipc;
#                         send_async() + wait_async(), 30 sends)
#   bench-cuda-cpu.json   GPU trainer, CPU workers (1024 MiB, 4 workers)
#   bench-cpu-cpu.json    the same bytes, CPU trainer and workers (what the row
#                         above is held against, with one page-locked D2H)
#   bench-cpu-cuda.json   CPU trainer, GPU workers (1024 MiB, 4 workers,
#                         --compare pinned-shm)
#   profile-cuda.txt      where a send's time goes on the GPU (64 MiB to one
#                         worker on the trainer's GPU, benchmarks/send_profile.py):
#                         blocking send(), back to back and with the trainer
#                         idle 20 ms after each; send_async() + wait_async()
#                         with its steps timed; and the costliest functions of
#                         the stall and of the worker's receive() (cProfile);
#                         before them, what the CUDA calls of a send cost, and
#                         a hand-written round trip to a worker process with
#                         its copy made in several ways, back to back and idle
#                         20 ms after each (benchmarks/cuda_calls.py --ipc)
#   bench-torchrl-cuda.json  trainer and workers on the GPU, beside torchrl's
#                         own schemes (multiprocess, shared, --compare
#                         torchrl-mp torchrl-shared; 1, 64 and 1024 MiB; 4 workers), where
#                         torchrl imports; else a line in the summary says why not
# (every bench case: the bytes as 4 tensors, each send checked on every worker)
# Each step has its own time limit, cut to what is left of the 6 minutes;
# a step that fails or runs out is reported and the next one runs, so one
# failure still leaves the other results. Ends 0 when every step passed,
# else 1, after the summary.
#
# Usage, from the project root: scripts/gpu_check.sh OUTDIR
#
# The machine is expected to have Python 3.12 with torch (a CUDA build),
# anyio, uvloop, xxhash and pytest, and no network. What weightsync and its
# tests need beyond that comes from .whl/ beside the working tree, fetched
# on a machine with network (CPython 3.12, manylinux x86_64):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl tensordict pyvers numpy cloudpickle pytest-asyncio pytest-timeout
# Only the wheels of modules that do not import are installed (into a
# folder of their own on PYTHONPATH, not into the machine's environment);
# weightsync itself runs from the working tree (PYTHONPATH, python -m
# weightsync), so no build step or setuptools is needed offline.
# torchrl 0.14 needs tensordict < 0.15, so torchrl's wheels and what they
# need beyond the above go into .whl/torchrl/, and from there into a second
# folder, first on PYTHONPATH for the torchrl step only:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl/torchrl torchrl==0.14.1 'tensordict<0.15' hoptorch orjson importlib_metadata zipp
#
# Environment: PYTHON (default python3); GPU_CHECK_NO_INSTALL=1 skips the
# install steps and uses the environment as it is; GPU_CHECK_SITE is where
# the wheels go (default /tmp/weightsync-gpu-site), GPU_CHECK_TORCHRL_SITE
# torchrl's (default /tmp/weightsync-gpu-site-torchrl); GPU_CHECK_BUDGET,
# the seconds the whole run may take (default 420); GPU_CHECK_ONLY, a
# space-separated list of step names, runs only those (and says so of the
# others).
set -u

if [ $# -ne 1 ]; then
    echo "usage: scripts/gpu_check.sh OUTDIR" >&2
    exit 2
fi
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
LOG=$OUT/gpu_check.log
SUMMARY=$OUT/summary.txt
PYTHON=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/weightsync-gpu-site}
TORCHRL_SITE=${GPU_CHECK_TORCHRL_SITE:-/tmp/weightsync-gpu-site-torchrl}
BUDGET=${GPU_CHECK_BUDGET:-420}
START=$(date +%s)
: >"$LOG"
: >"$SUMMARY"
failed=0

say() {
    echo "$*" | tee -a "$LOG"
}

# step NAME LIMIT COMMAND...: run COMMAND, its output into the log, for at
# most LIMIT seconds or what is left of the budget; Ctrl-C first (pytest
# prints its summary, the bench stops its workers), killed 10 s later.
step() {
    local name=$1 limit=$2 left began rc took status
    shift 2
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $name "* ]]; then
        echo "$name: not asked (GPU_CHECK_ONLY)" >>"$SUMMARY"
        return
    fi
    left=$((START + BUDGET - $(date +%s) - 10))
    if [ "$left" -lt "$limit" ]; then
        limit=$left
    fi
    if [ "$limit" -lt 5 ]; then
        say "== $name: skipped, the time is up"
        echo "$name: skipped (the time is up)" >>"$SUMMARY"
        failed=1
        return
    fi
    say "== $name (at most ${limit} s): $*"
    began=$(date +%s)
    timeout -s INT -k 10 "$limit" bash -c '"$@"' "$name" "$@" >>"$LOG" 2>&1
    rc=$?
    took=$(($(date +%s) - began))
    case $rc in
        0) status="ok" ;;
        124 | 137) status="timed out (limit ${limit} s)" ;;
        *) status="failed with exit status $rc" ;;
    esac
    [ "$rc" -eq 0 ] || failed=1
    say "== $name: $status, ${took} s"
    echo "$name: $status, ${took} s" >>"$SUMMARY"
}

facts() {
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    "$PYTHON" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available:", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i}:", torch.cuda.get_device_name(i))
EOF
}

install_missing() {
    local wheels="" module package found
    # module:wheel-name of what the tests and weightsync need beyond the machine's packages.
    for pair in tensordict:tensordict pyvers:pyvers numpy:numpy cloudpickle:cloudpickle \
        pytest_asyncio:pytest_asyncio pytest_timeout:pytest_timeout; do
        module=${pair%%:*}
        package=${pair#*:}
        if "$PYTHON" -c "import $module" 2>/dev/null; then
            echo "$module: already importable"
            continue
        fi
        found=$(ls .whl/"$package"-*.whl 2>/dev/null | head -n 1)
        if [ -z "$found" ]; then
            echo "$module: missing, and no .whl/$package-*.whl to install it from" >&2
            return 1
        fi
        wheels="$wheels $found"
    done
    if [ -n "$wheels" ]; then
        # shellcheck disable=SC2086
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" $wheels
    fi
}

bench() {
    "$PYTHON" -m weightsync bench --repeats 3 --warmup 1 --progress "$@"
}

# Every wheel of .whl/torchrl/ (torchrl, the tensordict it needs, and theirs),
# into a folder of its own: it shadows the main site's tensordict only where
# it comes first on PYTHONPATH (torchrl_bench).
install_torchrl() {
    # shellcheck disable=SC2046
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$TORCHRL_SITE" $(ls .whl/torchrl/*.whl)
}

torchrl_bench() {
    PYTHONPATH="$TORCHRL_SITE:$PYTHONPATH" bench "$@"
}

# The steps run in a shell of their own, under timeout.
export -f facts install_missing bench install_torchrl torchrl_bench
export PYTHON SITE TORCHRL_SITE

say "weightsync device check: $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
step facts 20 facts
if [ "${GPU_CHECK_NO_INSTALL:-0}" = 1 ]; then
    say "== install: skipped (GPU_CHECK_NO_INSTALL=1)"
    echo "install: skipped (GPU_CHECK_NO_INSTALL=1)" >>"$SUMMARY"
else
    step install 45 install_missing
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
step import 30 "$PYTHON" -c "import tensordict, weightsync; print('weightsync', weightsync.__version__)"
step pytest-cuda 150 "$PYTHON" -m pytest -m cuda -p no:cacheprovider -q -rfEs --durations=10
step bench-cuda-cuda 110 bench --trainer-device cuda --worker-device cuda \
    --scheme multiprocess shared --compare cuda-ipc --size 1 64 1024 --workers 4 --tensors 4 \
    --json "$OUT/bench-cuda.json"
# The fixed cost of a send: small sizes, many sends, one blocking send() each.
step bench-cuda-small 40 bench --trainer-device cuda --worker-device cuda \
    --scheme multiprocess shared --compare cuda-ipc --size 1 --workers 4 --tensors 4 \
    --blocking --repeats 30 --warmup 5 --json "$OUT/bench-cuda-small.json"
step bench-cuda-small-1 30 bench --trainer-device cuda --worker-device cuda \
    --scheme multiprocess --compare cuda-ipc --size 0.0625 --workers 1 --tensors 4 \
    --blocking --repeats 30 --warmup 5 --json "$OUT/bench-cuda-small-1.json"
step bench-cuda-cuda-1 40 bench --trainer-device cuda --worker-device cuda \
    --scheme multiprocess --compare cuda-ipc --size 64 --workers 1 --tensors 4 \
    --repeats 30 --warmup 5 --json "$OUT/bench-cuda-1.json"
# Where the time of a send goes on the GPU (the steps of the stall, then cProfile's view of it).
# A script's output, into the log and profile-cuda.txt.
profiled() {
    set -o pipefail
    "$PYTHON" "$@" 2>&1 | tee -a "$PROFILE"
}
export -f profiled
export PROFILE=$OUT/profile-cuda.txt
gpu_profile=(benchmarks/send_profile.py --device cuda --size 64 --workers 1)
step cuda-calls 40 profiled benchmarks/cuda_calls.py --ipc
step cuda-calls-gap 60 profiled benchmarks/cuda_calls.py --ipc --gap 20
step profile-cuda 60 profiled "${gpu_profile[@]}" --sends 300
step profile-cuda-gap 60 profiled "${gpu_profile[@]}" --sends 200 --gap 20
step profile-cuda-steps 60 profiled "${gpu_profile[@]}" --sends 300 --async --steps
step profile-cuda-cprofile 60 profiled "${gpu_profile[@]}" --sends 300 --async --cprofile 30
# torchrl's own schemes on the first placement, beside weightsync's, like for like.
if [ "${GPU_CHECK_NO_INSTALL:-0}" != 1 ] && ls .whl/torchrl/torchrl-*.whl >/dev/null 2>&1; then
    step install-torchrl 30 install_torchrl
fi
torchrl_args=(--trainer-device cuda --worker-device cuda --scheme multiprocess shared
    --compare torchrl-mp torchrl-shared --size 1 64 1024 --workers 4 --tensors 4
    --json "$OUT/bench-torchrl-cuda.json")
left=$((START + BUDGET - $(date +%s) - 10))
if [ "$left" -lt 5 ]; then
    step bench-torchrl-cuda 80 torchrl_bench "${torchrl_args[@]}" # says the time is up
elif found=$(PYTHONPATH="$TORCHRL_SITE:$PYTHONPATH" timeout "$((left < 30 ? left : 30))" "$PYTHON" -c \
    "import tensordict, torchrl.weight_update; print('torchrl', torchrl.__version__, 'tensordict', tensordict.__version__)" \
    2>&1); then
    say "$(echo "$found" | tail -n 1)"
    step bench-torchrl-cuda 80 torchrl_bench "${torchrl_args[@]}"
else
    found=$(echo "$found" | tail -n 1)
    say "== bench-torchrl-cuda: skipped, torchrl does not import: ${found:-timed out}"
    echo "bench-torchrl-cuda: skipped (torchrl does not import: ${found:-timed out})" >>"$SUMMARY"
fi

# The placements across the bus last: they held their targets before (no regression).
step bench-cuda-cpu 40 bench --trainer-device cuda --worker-device cpu \
    --scheme multiprocess --size 1024 --workers 4 --tensors 4 --json "$OUT/bench-cuda-cpu.json"
# The same bytes sent from a CPU trainer to CPU workers: the GPU trainer's row
# is held against page-locked D2H + this send.
step bench-cpu-cpu 40 bench --scheme multiprocess --size 1024 --workers 4 --tensors 4 \
    --json "$OUT/bench-cpu-cpu.json"
step bench-cpu-cuda 75 bench --trainer-device cpu --worker-device cuda \
    --scheme multiprocess --compare pinned-shm --size 1024 --workers 4 --tensors 4 \
    --json "$OUT/bench-cpu-cuda.json"
{
    echo "pytest: $(grep -E '^=*.*(passed|failed|skipped|error|deselected).* in [0-9.]+s' "$LOG" | tail -n 1)"
    echo "device: $(grep -m 1 -E '^(GPU 0|cuda:0):' "$LOG" || echo 'none visible')"
    echo "total: $(($(date +%s) - START)) s; results in $OUT"
} >>"$SUMMARY"
say ""
say "summary:"
tee -a "$LOG" <"$SUMMARY"
exit "$failed"
