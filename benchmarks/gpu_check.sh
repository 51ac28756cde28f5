#!/usr/bin/env bash
# Everything that needs a CUDA device, in one run of about 8 minutes on one H100 or H200:
#   1. the GPU tests (pytest -m gpu) under PyTorch's CUDA Stream Sanitizer;
#   2. GPU tensors through the host and disk tiers against plain pinned copies (gpu_copy.py);
#   3. the training-step benchmark on the GPU, every mode's gradients checked bit for bit
#      against plain training (a mode that differs is refused and the step fails), two
#      rounds with the modes taking turns;
#   4. with GPU_CHECK_SUITE=1, the suite with CUDA present (4 more minutes; GPU_CHECK_SUITE_S
#      sets its limit in seconds, default 240), where the host tier allocates pinned memory;
#   5. the training step with the default windows and on the disk tier (with 32 MiB and
#      256 MiB windows, and with only the biggest tensors offloaded), and the machine's disk
#      against its raw limit (tierstore-bench disk, dd or fio). GPU_CHECK_SHORT=1 skips this
#      step, for a lease too short for all of them (steps 1-4 take about 8 minutes).
# The steps run in that order, the most telling first, so a lease that runs short loses the least.
# Logs go to $OUT (default ./gpu-out). Packages the machine lacks can travel as wheels in
# .whl/ (zarr, numcodecs, donfig, google-crc32c, isal, pytest-asyncio); they are installed
# into python3's environment. Each step has its own time limit, so one that hangs leaves the
# rest to run.
#
#     bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    # Into python3's own environment: tests start child processes with a PYTHONPATH of their
    # own, which would hide a --target folder. Where that environment is read-only, /tmp/site.
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        .whl/*.whl; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site
    fi
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
spill=${SPILL_DIR:-/var/tmp}
failed=()

step() { echo; echo "== $1 ($(date -u +%T))"; }
check() { local rc=$?; [ $rc -eq 0 ] || failed+=("$1 (exit $rc)"); }
finish() {
    step "done${1:+ ($1)}"
    if [ ${#failed[@]} -gt 0 ]; then
        printf 'FAILED: %s\n' "${failed[@]}"
        exit 1
    fi
    echo "all steps passed"
    exit 0
}

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
echo "cores $(nproc), $(free -g | awk '/Mem/ {print $2}') GiB"
df -h "$spill" | tail -1

step "GPU tests under the CUDA Stream Sanitizer"
set -o pipefail
TORCH_CUDA_SANITIZER=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests \
    2>&1 | tee "$out/gpu-tests.log" | tail -15
check "GPU tests"

step "GPU tensors through the store"
timeout 60 python3 benchmarks/gpu_copy.py --size 64MiB --count 16 --rounds 3 --disk-dir "$spill" \
    2>&1 | tee "$out/gpu-copy.log"
check "gpu_copy"

step "training step on the GPU: 8 blocks, width 1024, sequence 1024, batch 4"
timeout 240 python3 -m tierstore.bench.train --device cuda --layers 8 --dim 1024 --heads 16 \
    --seq 1024 --batch 4 --warmup 2 --steps 3 --rounds 2 --disk-dir "$spill" \
    --modes none,save_on_cpu,torch_ckpt,disk_baseline,ts_host,ts_ckpt \
    --json "$out/train-cuda.jsonl" 2>&1 | tee "$out/train-cuda.log"
check "train"

if [ "${GPU_CHECK_SUITE:-0}" = 1 ]; then
    step "the suite with CUDA present (lint and type checks run on the CPU machine)"
    # Eight workers of two torch threads each. With torch's default of one thread per core in
    # every worker, 14 workers on 16 cores left a 4-second test still in its plain backward
    # pass after 60 s, and tests that wait on child processes failed. -v names each test as it
    # ends, so a log cut short by the time limit still says which failed.
    # At the limit, SIGINT: pytest then prints the failures it has so far (a killed run
    # prints none). To rerun some files, keep each directory's files together on the command
    # line: pytest 9.1.1, the GPU image's, loses a directory's conftest fixtures otherwise.
    OMP_NUM_THREADS=2 timeout -s INT -k 30 "${GPU_CHECK_SUITE_S:-240}" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider \
        -p no:benchmark -n 8 tests --ignore=tests/test_lint.py >"$out/suite.log" 2>&1
    check "suite"
    grep -E "(FAILED|ERROR) tests/|passed|failed" "$out/suite.log" | tail -40
fi

[ "${GPU_CHECK_SHORT:-0}" = 1 ] && finish "GPU_CHECK_SHORT=1: the remaining steps skipped"

step "the same with the store's default windows (256 MiB to prefetch, 256 MiB in flight)"
timeout 150 python3 -m tierstore.bench.train --device cuda --layers 8 --dim 1024 --heads 16 \
    --seq 1024 --batch 4 --warmup 2 --steps 3 --rounds 2 --disk-dir "$spill" \
    --prefetch-bytes 256MiB --inflight-bytes 256MiB --modes none,save_on_cpu,ts_host,ts_ckpt \
    2>&1 | tee "$out/train-cuda-windows.log"
check "train, default windows"

step "training step on the GPU, disk tier: 4 blocks, width 512, sequence 1024, batch 4"
timeout 60 python3 -m tierstore.bench.train --device cuda --layers 4 --dim 512 --heads 8 \
    --seq 1024 --batch 4 --warmup 1 --steps 2 --disk-dir "$spill" --modes none,ts_disk \
    2>&1 | tee "$out/train-cuda-disk.log"
check "train disk"

step "the same disk-tier step with the default windows (256 MiB), then only the 128 MiB maps"
# Its saved tensors include eight 128 MiB attention maps a step, more than the 32 MiB pinned
# pool and window above hold: they are staged in pageable memory and move one at a time.
# These two runs tell that apart from the rest of the disk path.
timeout 60 python3 -m tierstore.bench train --device cuda --layers 4 --dim 512 --heads 8 \
    --seq 1024 --batch 4 --warmup 1 --steps 2 --disk-dir "$spill" --modes ts_disk \
    --prefetch-bytes 256MiB --inflight-bytes 256MiB 2>&1 | tee "$out/train-cuda-disk-windows.log"
check "train disk, default windows"
timeout 60 python3 -m tierstore.bench train --device cuda --layers 4 --dim 512 --heads 8 \
    --seq 1024 --batch 4 --warmup 1 --steps 2 --disk-dir "$spill" --modes ts_disk \
    --min-bytes 134217728 2>&1 | tee "$out/train-cuda-disk-maps.log"
check "train disk, maps only"

step "this machine's disk: the store against the raw limit, 64 MiB tensors"
timeout 90 python3 -m tierstore.bench disk --sizes 64MiB --total 2GiB --repeats 2 \
    --engines raw-limit,tierstore-raw --dir "$spill" --no-progress 2>&1 | tee "$out/disk.log"
check "disk"

finish
