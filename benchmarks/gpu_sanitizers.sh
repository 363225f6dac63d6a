#!/usr/bin/env bash
# The sanitizers over the whole CUDA self-test, memcheck over the IPC
# self-test of two processes sharing the GPU, the architectures in the built module.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; fi
S=$OUT/summary.txt
echo "$(date -u) $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader)" | tee $S
( cmake -S . -B /tmp/stb -DJAX_BLINK_BUILD_SELFTEST=ON -DJAX_BLINK_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release >/tmp/stb.log 2>&1 && cmake --build /tmp/stb --target cuda_selftest -j 8 >>/tmp/stb.log 2>&1; echo "selftest build rc=$?" | tee -a $S ) &
SB=$!
python3 -m pip install -q --no-build-isolation --no-deps -Ccmake.define.JAX_BLINK_CUDA=ON -e . > $OUT/build.log 2>&1; echo "pip build rc=$?" | tee -a $S
so=$(python3 -c "import jax_blink._blink_cuda as m; print(m.__file__)"); cuobjdump --list-elf "$so" 2>&1 | sed 's/^/elf: /' | tee -a $S
wait $SB
for tool in memcheck synccheck initcheck; do
  t0=$(date +%s); timeout 100 compute-sanitizer --tool $tool /tmp/stb/cuda_selftest > $OUT/san-$tool.log 2>&1
  echo "$tool rc=$? $(( $(date +%s)-t0 ))s: $(grep -c '^PASS' $OUT/san-$tool.log) PASS, $(grep -c '^FAIL' $OUT/san-$tool.log) FAIL; $(grep 'ERROR SUMMARY\|passed, ' $OUT/san-$tool.log | tr '\n' ' ')" | tee -a $S
done
t0=$(date +%s); timeout 150 compute-sanitizer --tool racecheck /tmp/stb/cuda_selftest > $OUT/san-racecheck.log 2>&1
echo "racecheck rc=$? $(( $(date +%s)-t0 ))s: $(grep -c '^PASS' $OUT/san-racecheck.log) PASS, $(grep -c '^FAIL' $OUT/san-racecheck.log) FAIL; $(grep 'RACECHECK SUMMARY\|hazard' $OUT/san-racecheck.log | head -3 | tr '\n' ' ')" | tee -a $S
t0=$(date +%s); IPC_SELFTEST_QUICK=1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 compute-sanitizer --tool memcheck --target-processes all python3 tests/helpers/gpu_ipc_selftest.py --out $OUT/ipc.json > $OUT/san-ipc.log 2>&1
echo "ipc memcheck rc=$? $(( $(date +%s)-t0 ))s: $(grep 'ERROR SUMMARY' $OUT/san-ipc.log | tr '\n' ' ')" | tee -a $S
tail -5 $OUT/san-ipc.log
