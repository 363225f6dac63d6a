#!/usr/bin/env bash
# compute-sanitizer over jax_blink's GPU paths, one summary line per run in $OUT/summary.txt.
#   SAN_STEPS="build selftest ipc2" bash benchmarks/gpu_sanitizers.sh    (the default)
#   SAN_STEPS=multi bash benchmarks/gpu_sanitizers.sh                    (4 GPUs; the package built)
# Steps (names checked before anything runs):
#   build     pip build of the package (CUDA on) and the CUDA self-test, side by side
#   selftest  memcheck, synccheck, initcheck and racecheck over the whole CUDA self-test (ranks as streams)
#   ipc2      memcheck over the IPC self-test of two processes
#   driver    memcheck, racecheck, synccheck over benchmarks/gpu_collectives_driver.py: every
#             collective, dtype and kernel-path size on 2, 3 and 4 GPUs of one process (memcheck
#             one run per rank count; racecheck and synccheck 4 ranks up to 16 MiB)
#   ipc4      memcheck, racecheck, synccheck over the IPC self-test of 4 processes (--target-processes all)
#   multi     driver and ipc4
#   rs3       the open memcheck finding (benchmarks/NOTES.md): reduce-scatter on 3 GPUs, bfloat16,
#             64 MiB per rank, 4 calls: without the tool under XLA's platform allocator and under
#             its pool (every result checked), then memcheck under each allocator with every
#             launch's buffers logged (JAX_BLINK_LOG_BUFFERS=1); then benchmarks/peer_alloc_probe.py
#             (peer reads of buffers born at an address the reader freed, or after the reader's
#             kernel was launched) plain and under memcheck
# Only jax_blink's kernels are checked by default (SAN_KERNELS="--kernel-name kns=jax_blink": they
# live in namespace jax_blink; XLA's and NCCL's are left alone); SAN_KERNELS= checks every kernel.
# Every run is bounded (timeout, then SIGKILL 5 s later; the IPC self-test's children are killed by
# their process group after it); the summary line of each run (benchmarks/sanitizer_summary.py)
# counts errors in our kernels, in others and CUDA API errors. Knobs: SAN_DRIVER_ARGS (default
# --quick --reference host: numpy checks the results, so no NCCL set-up runs under the tool),
# SAN_T_<TOOL>_DRIVER (seconds per run, default 70) and SAN_T_IPC4 (seconds).
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
SAN_STEPS=${SAN_STEPS:-"build selftest ipc2"}
KNOWN=" build selftest ipc2 driver ipc4 multi rs3 "
for step in $SAN_STEPS; do  # a typo must not cost a GPU call
  [[ "$KNOWN" == *" $step "* ]] || { echo "gpu_sanitizers.sh: unknown step '$step'; steps:$KNOWN" >&2; exit 2; }
done
SAN_STEPS=" ${SAN_STEPS//multi/driver ipc4} "
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site/ortools ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # kept: a package put on the path by the caller
fi
S=$OUT/summary.txt
SAN_KERNELS=${SAN_KERNELS-"--kernel-name kns=jax_blink"}
echo "$(date -u) $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | head -1) x$(nvidia-smi -L | grep -c '^GPU ')" | tee -a $S
has() { [[ "$SAN_STEPS" == *" $1 "* ]]; }
summary() { python3 benchmarks/sanitizer_summary.py "$@" | tee -a $S; }
# Kill what a bounded run left behind: the process groups its Python parent listed.
reap() { [ -f "$1" ] && while read -r pid; do kill -9 -- "-$pid" 2>/dev/null; done < "$1"; rm -f "$1"; }

if has build || has selftest; then
  ( cmake -S . -B /tmp/stb -DJAX_BLINK_BUILD_SELFTEST=ON -DJAX_BLINK_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release >/tmp/stb.log 2>&1 && cmake --build /tmp/stb --target cuda_selftest -j 8 >>/tmp/stb.log 2>&1; echo "selftest build rc=$?" | tee -a $S ) &
  SB=$!
fi
if has build; then
  python3 -m pip install -q --no-build-isolation --no-deps -Ccmake.define.JAX_BLINK_CUDA=ON -e . > $OUT/build.log 2>&1; echo "pip build rc=$?" | tee -a $S
  so=$(python3 -c "import jax_blink._blink_cuda as m; print(m.__file__)"); cuobjdump --list-elf "$so" 2>&1 | sed 's/^/elf: /' | tee -a $S
fi
if has selftest; then
  wait $SB
  for tool in memcheck synccheck initcheck; do
    t0=$(date +%s); timeout 100 compute-sanitizer --tool $tool /tmp/stb/cuda_selftest > $OUT/san-$tool.log 2>&1
    echo "$tool rc=$? $(( $(date +%s)-t0 ))s: $(grep -c '^PASS' $OUT/san-$tool.log) PASS, $(grep -c '^FAIL' $OUT/san-$tool.log) FAIL; $(grep 'ERROR SUMMARY\|passed, ' $OUT/san-$tool.log | tr '\n' ' ')" | tee -a $S
  done
  t0=$(date +%s); timeout 150 compute-sanitizer --tool racecheck /tmp/stb/cuda_selftest > $OUT/san-racecheck.log 2>&1
  echo "racecheck rc=$? $(( $(date +%s)-t0 ))s: $(grep -c '^PASS' $OUT/san-racecheck.log) PASS, $(grep -c '^FAIL' $OUT/san-racecheck.log) FAIL; $(grep 'RACECHECK SUMMARY\|hazard' $OUT/san-racecheck.log | head -3 | tr '\n' ' ')" | tee -a $S
fi
if has ipc2; then
  t0=$(date +%s); IPC_SELFTEST_QUICK=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CHILD_PIDS_FILE=$OUT/.ipc2.pids timeout -k 5 200 compute-sanitizer --tool memcheck --target-processes all python3 tests/helpers/gpu_ipc_selftest.py --out $OUT/ipc.json > $OUT/san-ipc.log 2>&1
  rc=$?; reap $OUT/.ipc2.pids
  echo "ipc memcheck rc=$rc $(( $(date +%s)-t0 ))s: $(grep 'ERROR SUMMARY' $OUT/san-ipc.log | tr '\n' ' ')" | tee -a $S
  tail -5 $OUT/san-ipc.log
fi
# Multi-GPU runs: each buffer its own allocation (XLA's platform allocator), so that an access past
# a buffer is past an allocation and memcheck sees it (inside XLA's pool it would not); a longer
# budget per wait (kernels run 10-100x slower under the tools); no autotuning kernels.
SAN_ENV="XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_BLINK_TIMEOUT_S=30"
SAN_ENV="$SAN_ENV XLA_FLAGS=--xla_gpu_autotune_level=0"
if has driver; then
  # One run per rank count for memcheck, and 4 ranks up to 16 MiB (the two-shot kernel's first size)
  # for racecheck and synccheck: each run short enough to end in its summary line (the whole driver
  # in one run outlasted 80 s on 4 x H200, 2026-11-27)
  for run in "memcheck 2" "memcheck 3" "memcheck 4" "racecheck 4 4K,1M,16M" "synccheck 4 4K,1M,16M"; do
    set -- $run; tool=$1; ranks=$2; sizes=${3:-}
    var=SAN_T_${tool^^}_DRIVER; limit=${!var:-70}
    # numpy's reference: lax's would set NCCL up under the tool first (40 s and more on 4 x H200,
    # past the old limits, 2026-11-27)
    args="${SAN_DRIVER_ARGS:---quick --reference host} --ranks $ranks${sizes:+ --sizes $sizes}"
    t0=$(date +%s)
    env $SAN_ENV timeout -k 5 "$limit" compute-sanitizer --tool $tool $SAN_KERNELS \
      python3 benchmarks/gpu_collectives_driver.py $args --out "$OUT/driver-$tool-$ranks.json" > "$OUT/san-driver-$tool-$ranks.log" 2>&1
    rc=$?
    summary "$tool driver ($args)" "$OUT/san-driver-$tool-$ranks.log" "$rc" "$(( $(date +%s)-t0 ))"
    grep -h "^driver:\|FAILED\|error:" "$OUT/san-driver-$tool-$ranks.log" | head -4 | sed 's/^/  /' | tee -a $S
  done
fi
if has rs3; then
  RS3="benchmarks/gpu_collectives_driver.py --reference host --ranks 3 --sizes 64M --dtypes bfloat16 --calls 4 --collectives reduce_scatter"
  for alloc in platform default; do
    a=""; [ $alloc = platform ] && a="XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false"
    t0=$(date +%s); env $a timeout -k 5 120 python3 $RS3 > "$OUT/rs3-$alloc.log" 2>&1
    echo "rs3 without the tool, $alloc allocator: rc=$? $(( $(date +%s)-t0 ))s: $(grep -h '^driver:' "$OUT/rs3-$alloc.log")" | tee -a $S
    t0=$(date +%s); env $a JAX_BLINK_LOG_BUFFERS=1 JAX_BLINK_TIMEOUT_S=30 XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -k 5 120 \
      compute-sanitizer --tool memcheck $SAN_KERNELS python3 $RS3 > "$OUT/san-rs3-$alloc.log" 2>&1
    rc=$?; summary "memcheck rs3 ($alloc allocator)" "$OUT/san-rs3-$alloc.log" "$rc" "$(( $(date +%s)-t0 ))"
  done
  timeout -k 5 60 python3 benchmarks/peer_alloc_probe.py > "$OUT/peer-alloc-plain.log" 2>&1
  echo "peer_alloc_probe without the tool: rc=$?" | tee -a $S; grep -h "^moved\|^late" "$OUT/peer-alloc-plain.log" | tee -a $S
  for case in moved late; do
    t0=$(date +%s); timeout -k 5 90 compute-sanitizer --tool memcheck python3 benchmarks/peer_alloc_probe.py --case $case \
      > "$OUT/san-peer-alloc-$case.log" 2>&1
    rc=$?; summary "memcheck peer_alloc_probe $case" "$OUT/san-peer-alloc-$case.log" "$rc" "$(( $(date +%s)-t0 ))"
    grep -h "^$case" "$OUT/san-peer-alloc-$case.log" | tee -a $S
  done
fi
if has ipc4; then
  for tool in memcheck racecheck synccheck; do
    t0=$(date +%s)
    env $SAN_ENV IPC_SELFTEST_QUICK=2 CHILD_PIDS_FILE=$OUT/.ipc4.pids timeout -k 5 "${SAN_T_IPC4:-30}" \
      compute-sanitizer --tool $tool --target-processes all $SAN_KERNELS \
      python3 tests/helpers/gpu_ipc_selftest.py --processes 4 --out "$OUT/ipc4-$tool.json" > "$OUT/san-ipc4-$tool.log" 2>&1
    rc=$?; reap $OUT/.ipc4.pids
    summary "$tool ipc x4" "$OUT/san-ipc4-$tool.log" "$rc" "$(( $(date +%s)-t0 ))"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('  ipc x4 ok', d['ok'], [(p.get('process'), p.get('checks'), p.get('failures')) for p in d['processes']])" \
      "$OUT/ipc4-$tool.json" 2>/dev/null | tee -a $S
  done
fi
