#!/usr/bin/env bash
# Blink's hybrid transfer on 2 GPUs, kernel alone (the CUDA self-test's bench, no XLA):
#   1. the host channel's own rate per number of host blocks (share 1: all of it through pinned
#      host memory, 64 MiB);
#   2. NVLink alone (the trees) at 256 MiB and 1 GiB;
#   3. NVLink + host channel at 1 GiB for each share x host blocks.
# Needs the self-test binary (gpu_session.sh step selftest builds /tmp/selftest).
#   bash benchmarks/hybrid_sweep.sh   (knobs: ST, ALONE_BLOCKS, SHARES, HOST_BLOCKS, SIZES)
ST=${ST:-/tmp/selftest}
rows() { grep -v '^# jax_blink\|^ *bytes ' || true; }
echo "# host channel alone (share 1, 64 MiB): host column = share/blocks"
for h in ${ALONE_BLOCKS:-4 8 16 32}; do
  timeout 60 "$ST" --bench --mode hybrid --host-share 1 --host-blocks "$h" --min 64M --max 64M | rows
done
echo "# trees alone (NVLink only)"
timeout 60 "$ST" --bench --mode tree --min 256M --max 1G | rows
echo "# trees + host channel"
for size in ${SIZES:-1G}; do
  for h in ${HOST_BLOCKS:-8 16}; do
    for f in ${SHARES:-0.06 0.08 0.10 0.12}; do
      timeout 60 "$ST" --bench --mode hybrid --host-share "$f" --host-blocks "$h" --min "$size" --max "$size" | rows
    done
  done
done
if [ -n "${KNOBS:-}" ]; then  # the host channel's own rate (share 1, 16 blocks) per load / allocation knob
  echo "# host channel alone per knob (JAX_BLINK_HOST_LOADS cv|cg, JAX_BLINK_HOST_WC 1|0, chunk)"
  for loads in cv cg; do for wc in 1 0; do for chunk in 512K 2M 8M; do
    echo "loads=$loads wc=$wc chunk=$chunk"
    JAX_BLINK_HOST_LOADS=$loads JAX_BLINK_HOST_WC=$wc timeout 60 "$ST" --bench --mode hybrid --host-share 1 \
      --host-blocks 16 --host-chunk "$chunk" --min 64M --max 64M | rows
  done; done; done
fi
