#!/usr/bin/env bash
# One call of the GPU machine: build, self-test, test suite, benchmark. Run from the repo root;
# writes logs and tables under $OUT (default ./gpu_out). OR-Tools travels as wheels in .whl/
# (the device image has none): see README "GPU machines".
#   STEPS="build selftest tests bench" bash benchmarks/gpu_session.sh
# Steps: build selftest stbench tests sanitizer hybrid ce overhead ipc bench sanitize4 soak faults4
# multi train holds variants decode schedule twoshot cesweep linkprobe auto3 (hybrid and stbench use
# the self-test binary that selftest builds; ST_BIN names one built beforehand, e.g. carried in
# .carry/, and then nothing is compiled for it).
# Knobs: CUDA_ARCHS (the package's GPU architectures: all, the default, as users get it; native
# builds faster), TESTS (pytest paths), BENCH_ARGS (python -m jax_blink.tools.bench), ST_ARGS
# (the selftest step's arguments, e.g. "--filter twoshot"), ST_MODES and ST_BENCH_ARGS
# (the self-test's kernel bench: modes auto|tree|ll|oneshot|hybrid, e.g. "--max 64M"); step
# hybrid runs benchmarks/hybrid_sweep.sh (after selftest).
# Issue 31, on 4 GPUs (the package built; each step bounded, about 9 minutes for the three; `multi`
# is sanitize4 soak faults4): sanitize4 runs benchmarks/gpu_sanitizers.sh's steps driver and ipc4
# (memcheck, racecheck, synccheck over benchmarks/gpu_collectives_driver.py on 2-4 GPUs and over
# the IPC self-test of 4 processes; summary in $OUT/sanitize4/summary.txt); soak runs
# benchmarks/gpu_soak.py for SOAK_S seconds (default 15); faults4 runs benchmarks/gpu_faults.py
# (a skipping rank in one process; 4 processes: one that never calls, frees its memory early,
# never reaches a set-up, is killed mid-call, brings another shape).
# auto3 times what dispatch="auto" runs on 3 of the GPUs (all-reduce, all-gather, reduce-scatter,
# float32 and bfloat16, 1 KiB-256 MiB; about 2 minutes) and lists every ratio below 1.0.
# Issue 27 (the package built): twoshot runs benchmarks/twoshot_sweep.py (the two-shot kernel's
# knobs and psum taking turns in one process); cesweep runs benchmarks/ce_sweep.py (the copy
# engines' all-reduce against the executor and psum, 1 min on 4 x H200; CESWEEP_ARGS adds arguments,
# e.g. "--sizes 64M,1G --profile $OUT/cesweep-profile": a trace per variant and how its copies ran); linkprobe runs
# benchmarks/link_probe.py (peer copies, a kernel's peer stores and loads, bulk copies, alone, 1 to n - 1
# peers at once; copies with pinned host memory, 1 to n GPUs at once and beside the peer pushes;
# LINKPROBE_ENGINES picks, default ce,sm,tma,host; mix: copy engines and a kernel's stores at once; needs CuPy, no build).
# Issues 28 and 29 (the package built): train runs GPT-2 small and ResNet-50 with the four modes
# taking turns (psum, synchronous, overlapped, none) and keeps each mode's kernel table against the
# step without all-reduce (the traces too with TRAIN_KEEP_TRACES=1) (about 3 minutes
# on 4 x H200; TRAIN_ASYNC_ENGINE=ce runs the overlapped mode on copy engines; TRAIN_DISPATCH=auto
# times the modes as users get them (buckets psum was measured faster for go to psum); TRAIN_COLLECTIVE=switch
# times the unedited psum step under the switch, overlapped and not, instead; TRAIN_MODES="switch,psum-tree,switch-tree"
# picks the modes (the train tool's --modes; psum and the two baselines always); TRAIN_RESNET_ARGS="--batch 64"
# gives ResNet-50 more work per GPU (at its 32 images the step is host-bound on H200s); TRAIN_ASYNC_BLOCKS="8 12"
# adds a GPT-2 run per overlapped grid size, 1.5 min each);
# holds (issue 28): the GPU tests of hold= and switch_hold=, then ResNet-50 and GPT-2 small with
# each hold taking turns against psum (HOLDS_RUNS picks the runs: resnet-overlap resnet-switch
# gpt2-overlap gpt2-switch; HOLDS_TESTS=0 leaves the tests out);
# variants looks for session 16's 4-GPU fault: ResNet-50 (128 images per GPU) under the switch with
# switch-late alone, switch-8blocks alone, then those with switch and switch-tree taking turns (the
# run that faulted), each bounded (about 6 minutes in all); the train tool checks each mode against psum.
# decode runs the tensor-parallel decoder at DECODE_TP (default 2,4; about 4 minutes; DECODE_BATCH,
# DECODE_LAYOUT=sequence for all-gathers and reduce-scatters, batches a multiple of every tp); schedule
# prints where XLA put each overlapped start and done (benchmarks/overlap_schedule.py).
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
STEPS=${STEPS:-"build selftest tests bench"}
KNOWN_STEPS=" build selftest stbench tests sanitizer hybrid ce overhead ipc bench sanitize4 soak faults4 multi train holds variants decode schedule twoshot cesweep linkprobe auto3 "
for step in $STEPS; do  # every name checked before anything runs: a typo must not cost a GPU call
  [[ "$KNOWN_STEPS" == *" $step "* ]] || { echo "gpu_session.sh: unknown step '$step'; steps:$KNOWN_STEPS" >&2; exit 2; }
done
STEPS=${STEPS//multi/sanitize4 soak faults4}
HOLDS_ALL="resnet-overlap resnet-switch gpt2-overlap gpt2-switch"  # the holds step's runs
for run in ${HOLDS_RUNS:-}; do  # likewise checked before anything runs
  [[ " $HOLDS_ALL " == *" $run "* ]] || { echo "gpu_session.sh: unknown HOLDS_RUNS entry '$run'; runs: $HOLDS_ALL" >&2; exit 2; }
done
BENCH_ARGS=${BENCH_ARGS:-"-b 1K -e 1G -f 4 -d float32,bfloat16"}
CUDA_ARCHS=${CUDA_ARCHS:-all}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site/ortools ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
log() { echo "=== $*" | tee -a "$OUT/session.log"; }
# Kill what a bounded step left behind: the process groups its Python parent listed (CHILD_PIDS_FILE).
reap() { [ -f "$1" ] && while read -r pid; do kill -9 -- "-$pid" 2>/dev/null; done < "$1"; rm -f "$1"; }
ST=${ST_BIN:-/tmp/selftest}
# The self-test (tests/native/cuda_selftest.cu) through CMake, for this machine's GPUs only, in a
# build folder of its own: the flags are the shipped executor's, and pip's build is not touched.
ST_BUILD=/tmp/jax_blink_selftest_build
compile_selftest() {
  { cmake -S . -B "$ST_BUILD" $(command -v ninja >/dev/null && echo -G Ninja) -DCMAKE_BUILD_TYPE=Release -DJAX_BLINK_CUDA=ON -DJAX_BLINK_BUILD_SELFTEST=ON \
      -DJAX_BLINK_CUDA_ARCHS=native -DPython_EXECUTABLE="$(command -v python3)" \
    && cmake --build "$ST_BUILD" --target cuda_selftest && cp "$ST_BUILD/cuda_selftest" "$ST"; } \
    > "$OUT/selftest_build.log" 2>&1 || { tail -30 "$OUT/selftest_build.log"; }
}
ST_PID=
# The self-test binary (ST_BIN where given, else /tmp/selftest), compiled once: beside the build
# step's pip install where a later step needs it (its compile takes 1-2 minutes), else here.
build_selftest() {
  if [ -n "$ST_PID" ]; then wait "$ST_PID"; ST_PID=; fi
  if [ -z "${ST_BIN:-}" ] && [ ! -x "$ST" ]; then compile_selftest; fi
}
log "$(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
for step in $STEPS; do
  case $step in
    build)
      log build
      if [ -z "${ST_BIN:-}" ] && [ ! -x "$ST" ] && [[ " $STEPS " =~ \ (selftest|stbench|overhead|hybrid)\  ]]; then
        compile_selftest & ST_PID=$!
      fi
      probes=OFF; [[ " $STEPS " == *" overhead "* ]] && probes=ON  # the benchmark's no-op handlers
      python3 -m pip install -q --no-build-isolation --no-deps -Ccmake.define.JAX_BLINK_CUDA=ON \
        -Ccmake.define.JAX_BLINK_CUDA_ARCHS="$CUDA_ARCHS" -Ccmake.define.JAX_BLINK_BUILD_BENCH_PROBES=$probes -e . \
        > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
      python3 -c "import jax, jax_blink; print(jax.__version__, jax.devices(), jax_blink.backends())" 2>&1 | tee -a "$OUT/session.log"
      python3 -c "from jax_blink import _blink_cuda as g; print('built for sm', g.built_architectures(), 'PTX', \
g.ptx_architecture(), '| GPU 0:', g.device_problem(0) or 'the kernels load')" 2>&1 | tee -a "$OUT/session.log" ;;
    selftest|stbench)
      log "$step"
      build_selftest
      [ "$step" = selftest ] && { timeout 240 "$ST" ${ST_ARGS:-} 2>&1 | tee "$OUT/selftest.log" | grep -v "^PASS" | tail -40; }
      for mode in ${ST_MODES:-auto}; do  # the kernel per size: auto, or forced tree / ll / oneshot
        timeout 120 "$ST" --bench --mode "$mode" ${ST_BENCH_ARGS:-} 2>&1 | tee "$OUT/selftest_bench-$mode.log" | tail -30
      done ;;
    tests)
      log tests
      timeout 400 python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -25 ;;
    sanitizer)
      log sanitizer
      build_selftest
      for tool in memcheck racecheck; do
        timeout 150 compute-sanitizer --tool $tool /tmp/selftest --quick > "$OUT/sanitizer-$tool.log" 2>&1
        echo "$tool rc=$?"; tail -4 "$OUT/sanitizer-$tool.log"
      done ;;
    hybrid)
      log hybrid
      build_selftest
      ST=${ST_BIN:-/tmp/selftest} timeout 400 bash benchmarks/hybrid_sweep.sh 2>&1 | tee "$OUT/hybrid.log" | tail -30 ;;
    ce)  # the copy-engine host channel through XLA, 256 MiB-1 GiB (NOTES.md change 4)
      log ce
      JAX_BLINK_HOST_ENGINE=ce timeout 300 python3 -m jax_blink.tools.bench -b 256M -e 1G -f 4 -d float32 --slope 60 \
        -o "$OUT/ce" 2>&1 | tee "$OUT/ce.log" | tail -6 ;;
    overhead)  # issue 17: marginal cost per call of every row (bindings, handlers), XLA's command buffers on
      # (default) and off, each in two processes (the XLA op's own marginal moved between processes by
      # 0.78-1.02 us in one run); profiles of one chain; the LL kernel in a CUDA graph.
      log overhead
      for process in 1 2; do
        for cb in default none; do
          flags=${XLA_FLAGS:-}; [ $cb = none ] && flags="$flags --xla_gpu_enable_command_buffer="
          echo "--- command buffers $cb, process $process" | tee -a "$OUT/session.log"
          XLA_FLAGS="$flags" timeout 240 python3 benchmarks/xla_call_overhead.py \
            ${OVERHEAD_ARGS:---runs 40 --repeats 3} --out "$OUT/overhead.txt" 2>&1 | tail -13
        done
      done
      for cb in default none; do
        flags=${XLA_FLAGS:-}; [ $cb = none ] && flags="$flags --xla_gpu_enable_command_buffer="
        XLA_FLAGS="$flags" timeout 150 python3 benchmarks/call_profile.py --dump "/tmp/profile-$cb" 2>&1 \
          | sed "s/^##/## [cb $cb]/" | tee -a "$OUT/profile.txt" | grep -v "^  host"
      done
      tar czf "$OUT/profile-events.tgz" -C /tmp profile-default profile-none
      build_selftest
      timeout 120 "$ST" --bench --mode ll --min 1K --max 64K 2>&1 | tee "$OUT/selftest_bench-ll.log" | tail -12 ;;
    ipc)  # issue 14: two processes through CUDA IPC (one GPU each where there are two): checks,
          # timing against psum with each kernel's time, a bench file for the dispatch table, and
          # the timing again with the old grid cap (64 blocks) beside the default (one per SM)
      log ipc
      kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-')
      IPC_SELFTEST_PROFILE=1 timeout 300 python3 tests/helpers/gpu_ipc_selftest.py --out "$OUT/ipc-selftest.json" \
        --bench-out "$OUT/allreduce-ipc-$kind-$(date -u +%F).json" > "$OUT/ipc.log" 2>&1; echo "ipc selftest rc=$?"
      JAX_BLINK_IPC_BLOCKS=64 IPC_SELFTEST_TIMING=only timeout 200 python3 tests/helpers/gpu_ipc_selftest.py \
        --out "$OUT/ipc-timing-64-blocks.json" > "$OUT/ipc-64.log" 2>&1; echo "ipc 64 blocks rc=$?"
      python3 - "$OUT" <<'PY'
import json, sys
for name in ("ipc-selftest.json", "ipc-timing-64-blocks.json"):
    try:
        d = json.load(open(f"{sys.argv[1]}/{name}"))
    except OSError:
        continue
    for p in d["processes"]:
        print(name, "process", p.get("process"), "checks", p.get("checks"), "failures", p.get("failures", "?"))
        for t in p.get("timings", []):
            print("  ", {k: v for k, v in t.items() if k != "profile"}, t.get("profile", ""))
PY
      ;;
    sanitize4)  # issue 31: the sanitizers over 2-4 GPUs of one process and 4 processes (8 runs, 460 s at
      # most; 208 s on 4 x H200, 2026-11-27)
      log sanitize4
      SAN_STEPS=multi OUT="$OUT/sanitize4" timeout -k 10 460 bash benchmarks/gpu_sanitizers.sh > "$OUT/sanitize4.log" 2>&1
      echo "sanitize4 rc=$?" | tee -a "$OUT/session.log"; cat "$OUT/sanitize4/summary.txt" ;;
    soak)  # issue 31: mixed collectives for SOAK_S seconds on every GPU, memory before and after
      log "soak ${SOAK_S:-15} s"
      timeout -k 5 $(( ${SOAK_S:-15} + 30 )) python3 benchmarks/gpu_soak.py --duration "${SOAK_S:-15}" \
        --out "$OUT/soak.json" > "$OUT/soak.log" 2>&1
      echo "soak rc=$?" | tee -a "$OUT/session.log"; tail -12 "$OUT/soak.log" ;;
    faults4)  # issue 31: injected faults, one process of 4 GPUs and 4 processes (CUDA IPC), 160 s at most;
      # every case in a job of its own: in one shared job a failed recovery carried into the next case
      log faults4
      CHILD_PIDS_FILE="$OUT/.faults.pids" timeout -k 5 160 python3 benchmarks/gpu_faults.py --processes 4 --separate \
        --timeout-s 2 --job-timeout-s 40 --total-timeout-s 150 --out "$OUT/faults.json" > "$OUT/faults.log" 2>&1
      echo "faults4 rc=$?" | tee -a "$OUT/session.log"; reap "$OUT/.faults.pids"; tail -25 "$OUT/faults.log" ;;
    train)  # issue 28: the overlapped step against psum, with one profiled step per mode
      log train
      mkdir -p "$OUT/train"
      for model in "gpt2 full" "resnet medium"; do
        set -- $model
        JAX_BLINK_ASYNC_ENGINE=${TRAIN_ASYNC_ENGINE:-} timeout -k 5 200 python3 -m jax_blink.tools.train --model "$1" --size "$2" --collective "${TRAIN_COLLECTIVE:-overlap}" \
          --dispatch "${TRAIN_DISPATCH:-blink}" --steps 2 --timing-runs 10 --out "$OUT/train" --profile "/tmp/prof-$1" \
          ${TRAIN_MODES:+--modes "$TRAIN_MODES"} $([ "$1" = resnet ] && echo "${TRAIN_RESNET_ARGS:-}") > "$OUT/train-$1.log" 2>&1
        echo "train $1 rc=$?" | tee -a "$OUT/session.log"; grep -v "^  bucket" "$OUT/train-$1.log" | tail -14
        # The kernel tables always come back; the traces (15-35 MB a step) only with TRAIN_KEEP_TRACES=1:
        # more than a few of them make what $OUT returns too large, and then nothing comes back.
        for k in /tmp/prof-$1/kernels-*-vs-none.txt; do [ -f "$k" ] && cp "$k" "$OUT/train/$1-$(basename "$k")"; done
        if [ "${TRAIN_KEEP_TRACES:-0}" = 1 ]; then
          for m in psum none none-barrier blink overlap switch switch-auto switch-sparse switch-late switch-sync psum-tree switch-tree; do
            t=$(find "/tmp/prof-$1/$m" -name "*.trace.json.gz" 2>/dev/null | head -1)
            [ -n "$t" ] && cp "$t" "$OUT/train/$1-$m-step.trace.json.gz"
          done
        fi
      done
      # TRAIN_ASYNC_BLOCKS="8 12": GPT-2 again with the overlapped kernels' grid at each size (the
      # default 24 blocks slowed the compute beside them by about as much as they hid, NOTES change 14)
      for blocks in ${TRAIN_ASYNC_BLOCKS:-}; do
        JAX_BLINK_ASYNC_BLOCKS=$blocks timeout -k 5 200 python3 -m jax_blink.tools.train --model gpt2 --size full \
          --collective overlap --steps 2 --timing-runs 10 --out "$OUT/train-blocks$blocks" > "$OUT/train-gpt2-blocks$blocks.log" 2>&1
        echo "train gpt2 async blocks $blocks rc=$?" | tee -a "$OUT/session.log"; grep "ms " "$OUT/train-gpt2-blocks$blocks.log" | tail -4
      done ;;
    holds)  # issue 28: what the overlapped starts hold (hold= / switch_hold=), the GPU tests, then the
      # models with each hold taking turns against psum (HOLDS_RUNS picks of $HOLDS_ALL; each about
      # 4-5 minutes on 4 x H200, ResNet-50 at 128 images per GPU)
      log holds
      mkdir -p "$OUT/holds"
      if [ "${HOLDS_TESTS:-1}" = 1 ]; then
        timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_async_gpu.py tests/gpu/test_switch_gpu.py \
          -k "overlapped_on_gpus or holds_on_gpus" > "$OUT/holds/tests.log" 2>&1
        echo "holds tests rc=$?" | tee -a "$OUT/session.log"; tail -3 "$OUT/holds/tests.log"
      fi
      for run in ${HOLDS_RUNS:-$HOLDS_ALL}; do
        case $run in
          resnet-overlap) model="resnet --size medium --batch 128"; collective=overlap
                          modes=overlap,overlap-none,overlap-weights,overlap-none-last16 ;;
          resnet-switch) model="resnet --size medium --batch 128"; collective=switch; modes=switch,switch-weights,switch-none-last16 ;;
          gpt2-overlap) model="gpt2 --size full"; collective=overlap; modes=overlap,overlap-none,overlap-weights ;;
          gpt2-switch) model="gpt2 --size full"; collective=switch; modes=switch,switch-weights,switch-tree,switch-tree-weights ;;
        esac
        timeout -k 5 280 python3 -m jax_blink.tools.train --model $model --collective $collective --steps 2 --timing-runs 10 \
          --modes "$modes" --profile "/tmp/prof-$run" --out "$OUT/holds" > "$OUT/holds/$run.log" 2>&1
        echo "holds $run rc=$?" | tee -a "$OUT/session.log"; grep -v "^  bucket" "$OUT/holds/$run.log" | tail -12
        for k in /tmp/prof-$run/kernels-*-vs-none.txt; do [ -f "$k" ] && cp "$k" "$OUT/holds/$run-$(basename "$k")"; done
      done ;;
    variants)  # issue 28: session 16's fault on 4 GPUs, one switch variant at a time, then together
      log variants
      mkdir -p "$OUT/variants"
      for modes in switch-late switch-8blocks switch,switch-late,switch-8blocks,switch-tree; do
        tag=${modes//,/+}
        timeout -k 5 $([ "$tag" = "${modes}" ] && echo 110 || echo 170) python3 -m jax_blink.tools.train --model resnet \
          --size medium --batch 128 --collective switch --steps 2 --timing-runs 10 --modes "$modes" \
          --out "$OUT/variants" > "$OUT/variants-$tag.log" 2>&1
        echo "variants $modes rc=$?" | tee -a "$OUT/session.log"
        grep -E "MISMATCH|error|Error|ILLEGAL|corrupted| ok, | ms " "$OUT/variants-$tag.log" | grep -v "Failed to unload" | head -16
      done ;;
    decode)  # issue 29: decode steps of the Llama-shaped model, tp = DECODE_TP
      log decode
      timeout -k 5 300 python3 -m jax_blink.tools.decode --size 8b --layers 8 --tp "${DECODE_TP:-2,4}" \
        --batch "${DECODE_BATCH:-1,4,16,64}" --layout "${DECODE_LAYOUT:-allreduce}" --rounds 6 \
        -o "$OUT/decode" > "$OUT/decode.log" 2>&1
      echo "decode rc=$?" | tee -a "$OUT/session.log"; grep -E "^tp=|psum |blink |switch |none " "$OUT/decode.log" ;;
    schedule)  # issue 28: where XLA placed the overlapped starts and dones
      log schedule
      timeout -k 5 100 python3 benchmarks/overlap_schedule.py --layers 6 --width 2048 --runs 10 \
        > "$OUT/schedule.log" 2>&1; echo "schedule rc=$?"; tail -16 "$OUT/schedule.log" ;;
    twoshot)  # issue 27: the two-shot kernel's pieces, pull mode and grid against psum, 3+ GPUs (1 min on 4 x H200)
      log twoshot
      timeout -k 5 170 python3 benchmarks/twoshot_sweep.py --out "$OUT/twoshot" > "$OUT/twoshot.log" 2>&1
      echo "twoshot rc=$?" | tee -a "$OUT/session.log"; grep -v "^|" "$OUT/twoshot.log" | tail -24 ;;
    cesweep)  # issue 27/28: the copy engines' all-reduce, back to back, against the executor and psum
      log cesweep
      timeout -k 5 170 python3 benchmarks/ce_sweep.py --out "$OUT/cesweep" ${CESWEEP_ARGS:-} > "$OUT/cesweep.log" 2>&1
      echo "cesweep rc=$?" | tee -a "$OUT/session.log"; grep -v "^|" "$OUT/cesweep.log" | tail -22 ;;
    linkprobe)  # issue 27: peer copies and stores alone, 1 to n - 1 peers per GPU at once; pinned host copies
      log linkprobe
      timeout -k 5 160 python3 benchmarks/link_probe.py --engines "${LINKPROBE_ENGINES:-ce,sm,tma,host}" \
        --out "$OUT/link-probe.md" > "$OUT/linkprobe.log" 2>&1
      echo "linkprobe rc=$?" | tee -a "$OUT/session.log"; tail -14 "$OUT/linkprobe.log" ;;
    bench)
      log bench
      timeout 500 python3 -m jax_blink.tools.bench $BENCH_ARGS -o "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
    auto3)  # issue 27: what dispatch="auto" runs on 3 of the GPUs, every collective of the table
      log auto3
      CUDA_VISIBLE_DEVICES=0,1,2 timeout 300 python3 -m jax_blink.tools.bench --dispatch auto -c allreduce,allgather,reducescatter \
        -b 1K -e 256M -f 8 -d float32,bfloat16 --kind "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-')-x3" \
        -o "$OUT/auto3" > "$OUT/auto3.log" 2>&1; echo "auto3 rc=$?" | tee -a "$OUT/session.log"
      grep -E "^ *[0-9]" "$OUT/auto3.log" | awk '$10 < 1.0 {print "below 1.0:", $0}' | tee -a "$OUT/session.log" ;;
  esac
done
