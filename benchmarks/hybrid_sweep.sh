#!/usr/bin/env bash
# Blink's hybrid transfer on 2 GPUs, kernel alone (the CUDA self-test's bench, no XLA), per host
# channel engine (ENGINES: sm = the kernel's host blocks move the bytes, ce = copy engines):
#   1. the host channel's own rate (share 1: all of it through pinned host memory, 64 MiB);
#   2. NVLink alone (the trees) at 256 MiB and 1 GiB;
#   3. NVLink + host channel at each size in SIZES for each share x host blocks.
# Needs the self-test binary (gpu_session.sh step selftest builds /tmp/selftest).
#   bash benchmarks/hybrid_sweep.sh   (knobs: ST, ENGINES, ALONE_BLOCKS, SHARES, CE_SHARES, HOST_BLOCKS, SIZES)
ST=${ST:-/tmp/selftest}
rows() { grep -v '^# jax_blink\|^ *bytes ' || true; }
echo "# trees alone (NVLink only)"
timeout 60 "$ST" --bench --mode tree --min 256M --max 1G | rows
for engine in ${ENGINES:-sm}; do
  if [ "$engine" = ce ]; then shares=${CE_SHARES:-0.09 0.10 0.11 0.12}; else shares=${SHARES:-0.06 0.071 0.08}; fi
  echo "# [$engine] host channel alone (share 1, 64 MiB): host column = share/blocks"
  for h in ${ALONE_BLOCKS:-16}; do
    timeout 60 "$ST" --bench --mode hybrid --host-engine "$engine" --host-share 1 --host-blocks "$h" --min 64M --max 64M | rows
  done
  echo "# [$engine] trees + host channel"
  for size in ${SIZES:-1G}; do
    for h in ${HOST_BLOCKS:-16}; do
      for f in $shares; do
        timeout 60 "$ST" --bench --mode hybrid --host-engine "$engine" --host-share "$f" --host-blocks "$h" --min "$size" --max "$size" | rows
      done
    done
  done
done
