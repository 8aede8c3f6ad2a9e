#!/usr/bin/env bash
# One GPU session, prepared on a CPU host and run in one command on a GPU host whose image
# has python3 with a CUDA build of torch (and transformers, pytest, hypothesis, safetensors,
# prometheus-client, tqdm), where nothing can be fetched:
#
#   bash bench/gpu_session.sh OUT STAGE...
#
# STAGE: tests (every test that skips without CUDA), bench (bench/gpu.py, block-major, the
# recorded configuration), big (the largest Llama-2-7B-shaped model the disk holds, trained
# with block-major and its blocks' weights streamed from SSD), wide (bench/gpu.py's capped
# in-GPU ceiling alone at the widths WIDE_WIDTHS, default "4096 5120": the kernel model's GEMM
# curve is fitted on 2048-wide runs only, and what it prices wider blocks at decides the
# paper's-box predictions, docs/design/iteration-model.md), retest FILTER (pytest -k FILTER on
# the CUDA tests). Logs and JSON results go to OUT.
#
# Set-up, all from the working tree: wheels in .whl/ (grpcio, grpcio-health-checking,
# protobuf, crc32c, cffi, pycparser for the host's Python) are installed into /tmp/site;
# Debian's liburing packages in .deb/ are unpacked into /tmp/uring and fuyoud's two C
# extensions are built in place (without a compiler or Python's headers fuyoud falls back to
# its thread-pool I/O engine and torch's codec); the packages are put on PYTHONPATH from the
# checkout (no install). Each stage has its own time limit; the session prints a summary last.
# TESTS_TIMEOUT, BENCH_TIMEOUT, WIDE_TIMEOUT (each width) and BIG_TIMEOUT limit the stages (BIG_TIMEOUT's default: what is
# left of SESSION_LIMIT seconds, 900 unless set). BENCH_ARGS, WIDE_ARGS and BIG_ARGS add to (and override)
# the stages' arguments: with --cpu, --device stand-in and small sizes the whole session runs on
# a CPU host first.
set -u
OUT="${1:?usage: gpu_session.sh OUT STAGE...}"; shift
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[session +$(( $(date +%s) - T0 ))s] $*"; }
SUMMARY=()

setup() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || log "wheels did not install"
    fi
    export PYTHONPATH="/tmp/site:$PWD:$PWD/client:$PWD/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    if compgen -G ".deb/*.deb" >/dev/null; then
        for f in .deb/*.deb; do dpkg -x "$f" /tmp/uring; done
        local lib=/tmp/uring/usr/lib/x86_64-linux-gnu
        export CFLAGS="-I/tmp/uring/usr/include" LDFLAGS="-L$lib" LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    for ext in uring lowp; do
        timeout 120 python3 native/build_$ext.py >/dev/null 2>"$OUT/build-$ext.log" && log "built fuyoud._$ext" \
            || log "fuyoud._$ext not built (fallback): $(tail -1 "$OUT/build-$ext.log")"
    done
    python3 - <<'EOF' 2>&1 | tee "$OUT/host.txt"
import os, platform, shutil, torch, transformers, grpc, google.protobuf
from fuyoud.io import uring
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__,
      "grpcio", grpc.__version__, "protobuf", google.protobuf.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("io_uring", uring.available())
print("cpus", os.cpu_count(), "memory GiB", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
      "/tmp free GiB", shutil.disk_usage("/tmp").free / 2**30)
EOF
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/host.txt"
    GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200|a100|l40s|4090' | tr A-Z a-z)
    GPU=${GPU:-gpu}
    log "set-up done ($GPU)"
}

cuda_tests() {  # $1: the -k filter, $2: the log's name
    log "CUDA tests (-k '$1')"
    timeout "${TESTS_TIMEOUT:-170}" python3 -m pytest -q -rA -p no:cacheprovider --timeout 100 -k "$1" \
        tests/test_device.py tests/test_blockmajor.py tests/test_blockmajor_swap.py tests/test_meta.py \
        tests/test_distributed.py >"$OUT/$2" 2>&1
    local rc=$?
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^E  |passed|failed" "$OUT/$2" | tail -60
    SUMMARY+=("$2: $(grep -E '[0-9]+ (passed|failed)' "$OUT/$2" | tail -1) (rc $rc)")
}

bench() {
    log "bench/gpu.py, block-major, 4 GiB cap"
    rm -rf /tmp/bench
    timeout "${BENCH_TIMEOUT:-330}" python3 bench/gpu.py --json "$OUT/gpu-$GPU.json" --cap 4GiB --micro 8 --accum 64 --weights host \
        --iters 1 --no-zero --deadline "${BENCH_DEADLINE:-200}" --dir /tmp/bench ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu-bench.log" | tail -60
    # A case that died leaves its private fuyoud shutting down (its parent's death), which on
    # the H200 took over 60 s with 28 GB of data files open. After 30 s each one left writes
    # every thread's stack to its log (SIGUSR1: what it waits for), the logs are kept, and
    # they are killed, which closes their files at once (the bench is over; nothing of theirs
    # is kept).
    local ours="fuyoud --config /tmp/bench/"  # (the bench's daemons only: not the host's, nor a test run's)
    for _ in $(seq 30); do pgrep -f "$ours" >/dev/null || break; sleep 1; done
    if pgrep -f "$ours" >/dev/null; then
        log "fuyoud processes still running 30 s after the bench: their stacks in $OUT/lingering-*.log, then killed"
        pkill -USR1 -f "$ours"; sleep 2
        local n=0 f
        for f in $(find /tmp/bench -name fuyoud.log 2>/dev/null); do n=$((n + 1)); cp "$f" "$OUT/lingering-$n.log"; done
        pkill -9 -f "$ours"
        for _ in $(seq 10); do pgrep -f "$ours" >/dev/null || break; sleep 1; done
    fi
    rm -rf /tmp/bench
    SUMMARY+=("bench: $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r.get(k) for k in ('fuyou_tflops','inmem_ceiling_tflops','inmem_same_model_tflops','fuyou_over_ceiling','fuyou_over_inmem_same_model','gpu_busy_fraction','errors')})" "$OUT/gpu-$GPU.json" 2>&1 | tail -3)")
}

wide() {  # the capped ceiling alone at wider blocks: its NVML busy time per micro-batch is what
    # bench/kernel_fit.py fits the GEMM curve on (copy the JSONs to bench/results/gpu-<gpu>/)
    local w
    for w in ${WIDE_WIDTHS:-4096 5120}; do
        log "bench/gpu.py, the capped in-GPU ceiling alone, width $w"
        rm -rf /tmp/wide
        timeout "${WIDE_TIMEOUT:-150}" python3 bench/gpu.py --json "$OUT/gpu-wide-$w-$GPU.json" --width "$w" --cap 24GiB \
            --micro 8 --accum 8 --cases ceiling --no-zero --iters 1 --ceiling-micro-max 8 --ssd-probe 256MiB --probe-bytes 256MiB \
            --dir /tmp/wide ${WIDE_ARGS:-} 2>&1 | tee "$OUT/gpu-wide-$w.log" | grep -E "ceiling|error|Error" | tail -8
        SUMMARY+=("wide $w: $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); i=r.get('ceiling_info') or {}; c=r['results'].get('ceiling') or {}; print({'layers': i.get('layers'), 'micro': i.get('micro'), 'checkpointing': i.get('checkpointing'), 'tflops': c.get('tflops'), 'busy': c.get('busy'), 'micro_batch_seconds': c.get('micro_batch_seconds')})" "$OUT/gpu-wide-$w-$GPU.json" 2>&1 | tail -1)")
    done
    rm -rf /tmp/wide
}

big() {
    log "a Llama-2-7B-shaped model on the GPU, block-major, weights from SSD"
    rm -rf /tmp/big; mkdir -p /tmp/big
    local layers rc=2 left=$(( ${SESSION_LIMIT:-900} - $(date +%s) + T0 - 15 ))
    [ "$left" -lt 10 ] && left=10
    for layers in 32 28 24 20 16; do  # the largest the disk holds (bigmodel.py refuses with exit 2 otherwise)
        timeout "${BIG_TIMEOUT:-$left}" python3 bench/bigmodel.py --json "$OUT/bigmodel-llama-$GPU.json" --family llama \
            --width 4096 --layers $layers --mlp 11008 --heads 32 --vocab 32000 --over 0 --seq 1024 --batch 8 \
            --micro-batches 8 --schedule block-major --state-dtype int8 --device cuda --dtype bf16 \
            --steps "${BIG_STEPS:-2}" --host-budget 20GiB --lr 1e-4 --dir /tmp/big --bare-size 2GiB ${BIG_ARGS:-} \
            2>&1 | tee "$OUT/bigmodel.log" | grep -vE "^  [a-z' ]+ +[0-9]+ x" | tail -25
        rc=${PIPESTATUS[0]}
        [ "$rc" -ne 2 ] && break
        log "$layers layers do not fit the disk"
    done
    rm -rf /tmp/big
    SUMMARY+=("big: rc $rc, $(tail -1 "$OUT/bigmodel.log" | cut -c1-600)")
}

setup
while [ $# -gt 0 ]; do
    case "$1" in
        tests) cuda_tests "cuda or nccl" cuda-tests.log ;;
        retest) shift; cuda_tests "$1" cuda-retest.log ;;
        bench) bench ;;
        big) big ;;
        wide) wide ;;
        *) log "unknown stage $1" ;;
    esac
    shift
done
log "done"
printf '%s\n' "${SUMMARY[@]}"
