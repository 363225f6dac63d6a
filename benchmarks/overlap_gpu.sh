#!/usr/bin/env bash
# Issue 28 on a GPU machine (~5 minutes on 4 GPUs, after the lead's rebuild): the asynchronous
# all-reduce's GPU tests, then the train tool (psum / jax_blink / jax_blink overlapped / no
# all-reduce taking turns) on GPT-2 small and ResNet-50 at 4 and 2 GPUs, with one profiled step of
# each mode on GPT-2 small at 4 GPUs, its overlap figures and a timeline PNG. Results under $OUT.
set -u
OUT=${OUT:-/tmp/overlap_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() { echo "== $*" | tee -a "$OUT/summary.txt"; "$@" 2>&1 | tail -25 | tee -a "$OUT/summary.txt"; }

run timeout 120 python -m pytest -q -x tests/gpu/test_async_gpu.py
for devs in 0,1,2,3 0,1; do
  prof=()
  [ "$devs" = 0,1,2,3 ] && prof=(--profile "$OUT/prof")
  CUDA_VISIBLE_DEVICES=$devs run timeout 110 python -m jax_blink.tools.train --model gpt2 --size full \
      --collective overlap --steps 2 --timing-runs 8 --out "$OUT/train" "${prof[@]}"
  CUDA_VISIBLE_DEVICES=$devs run timeout 80 python -m jax_blink.tools.train --model resnet --size medium \
      --collective overlap --steps 2 --timing-runs 8 --out "$OUT/train"
done
# The overlapped mode's trace: the timeline picture, and the trace itself, compressed, if < 16 MiB.
trace=$(ls "$OUT"/prof/overlap/plugins/profile/*/*.trace.json.gz 2>/dev/null | tail -1)
if [ -n "$trace" ]; then
  timeout 60 python -c "
import sys; from jax_blink.tools import trace_overlap as t
tr = t.load(sys.argv[1]); s = t.summarize(tr); print(t.describe(s))
t.timeline_png(tr, sys.argv[2], title='GPT-2 small, 4 GPUs, one step, jax_blink overlapped (measured)')
" "$trace" "$OUT/overlap_timeline.png" | tee -a "$OUT/summary.txt"
  psum_trace=$(ls "$OUT"/prof/psum/plugins/profile/*/*.trace.json.gz 2>/dev/null | tail -1)
  [ -n "$psum_trace" ] && timeout 60 python -c "
import sys; from jax_blink.tools import trace_overlap as t
t.timeline_png(t.load(sys.argv[1]), sys.argv[2], title='GPT-2 small, 4 GPUs, one step, psum (measured)')
" "$psum_trace" "$OUT/psum_timeline.png"
  size=$(stat -c %s "$trace")
  if [ "$size" -lt 16000000 ]; then cp "$trace" "$OUT/gpt2-overlap-step.trace.json.gz"; else echo "trace $size bytes: not kept" | tee -a "$OUT/summary.txt"; fi
fi
rm -rf "$OUT/prof"  # the raw profile folders (xplane.pb) are too large to come back
