// Two-shot all-reduce by remote writes (Mode::kTwoShot): reduce-scatter, then all-gather, every
// byte over NVLink a store into a peer's own output buffer. Included by cuda/executor.cu after
// cuda/device_kernels.cuh, whose flags, pointer exchange and data movers it uses.
//
// ## Layout
// The operand of N elements is cut into n equal *chunks* of C elements (C a multiple of 16 bytes,
// n * C <= N); rank j owns chunk j, and the *tail* [n C, N) (fewer than n 16-byte atoms) is
// reduced by every rank itself. Each chunk is cut alike into Q = m * G *pieces*; piece q of every
// chunk belongs to block q mod G on every rank.
//
// ## Push mode (no rank's in == out in this call)
// Rank r's `out` has one region per chunk. Region s of rank j's `out` first receives rank s's
// *contribution* to chunk j (s's `in` over chunk j), and later the final chunk s, which s
// broadcasts. Per piece q, block b of rank r:
//   A  copies in[chunk j, q] into rank j's out[region r, q] for every j != r, release-flags (A, q)
//      on j.
//   B  waits for (A, q) from every peer, reduces chunk r's piece in rank order (its own `in` for
//      itself, out[region s] for peer s) into out[chunk r, q], release-flags (B, q) on every peer:
//      "my regions' piece q are read".
//   C  waits for (B, q) from every peer (each has read what this rank wrote into its region r),
//      then copies out[chunk r, q] into every peer's out[region r, q], release-flags (C, q).
//   Exit: waits for (C, q) from every peer (their final pieces landed in this rank's `out`).
// With JAX_BLINK_TWOSHOT_PUSH=spread, A alternates between the peers every 32 KiB per block instead
// of sending each peer its whole piece in turn (measured no different: NOTES, change 20).
// Blocks run their pieces software-pipelined (A of piece i, B of i - 1, C of i - 2), so that
// NVLink stays busy while other pieces reduce. With JAX_BLINK_TWOSHOT_REDUCERS = R > 0 the last R
// blocks run every piece's B (in increasing order) and the others A and C; a C then also waits
// for its own rank's B (a flag in the rank's own inbox). Measured slower (NOTES, change 17): off
// by default.
// ## Pull mode (some rank's in == out: a peer's contribution would overwrite an operand; or
// JAX_BLINK_TWOSHOT_MODE=pull, which measures the remote reads against the remote writes)
// B reads the peers' `in` in place instead (no A); C needs no (B, q) wait: region r of rank j is
// written only by rank r, after r itself read j's `in` there. Exit as above, which also keeps every
// peer's reads of this rank's `in` before this rank returns (they precede the peer's (C, q)).
//
// ## Why it is safe
// Pointers: block 0 publishes this call's (in, out) into every peer and every block waits for every
// peer's (the tree kernel's two-slot table: every rank waits for every other in every call, so no
// rank is a call ahead of another's table slot). A peer's kernel of call k runs, so its buffers'
// previous use is over, before anything is written there. Deadlock: a block's waits are for its
// peers' same block, on steps those take earlier in the same order (A(i) needs pointers only, B(i)
// needs A(i), C(i) needs B(i), exit needs C), so the smallest blocked step's producer would be
// blocked on an even smaller one: none. Residency as for the tree kernel (the grid fits at once).
// Every rank computes chunk j's result from the same terms in the same order on rank j alone, and
// the tail in rank order on every rank: bitwise identical results everywhere.
#pragma once

namespace jax_blink::cuda {
namespace {

constexpr int kMaxTwoShotTail = 16 * kMaxLLRanks;  // tail elements: < n 16-byte atoms, n <= 8

__device__ __forceinline__ void ts_piece(const Params& p, int64_t q, int64_t* lo, int64_t* len) {
  const int64_t align = p.ts_align, atoms = p.ts_chunk / align;
  const int64_t a = q * atoms / p.ts_pieces, b = (q + 1) * atoms / p.ts_pieces;
  *lo = a * align;
  *len = (b - a) * align;
}

// Flags of this site's inbox (inbox_at's layout with nunits = 2 Q): A at (phase 0, q), B at
// (phase 1, q), C at (phase 0, Q + q).
__device__ __forceinline__ uint32_t* ts_flag(const Params& p, uint8_t* base, int src, int step, int64_t q) {
  const int phase = step == 1 ? 1 : 0;
  const int64_t u = step == 2 ? p.ts_pieces + q : q;
  return inbox_at(p, base, src, phase, static_cast<int>(u));
}

// dsts[d][i] = srcs[d][i] for d < nd, i < len (block-wide; srcs are this rank's memory): each
// round of kThreads * kUnroll vectors goes to every destination before the next round, so the
// block's stores alternate between its destinations at that grain.
template <class S>
__device__ void scatter_range(S* const* dsts, const S* const* srcs, int nd, int64_t len) {
  constexpr int V = 16 / sizeof(S);
  uintptr_t bits = 0;
  for (int d = 0; d < nd; ++d) bits |= reinterpret_cast<uintptr_t>(dsts[d]) | reinterpret_cast<uintptr_t>(srcs[d]);
  const int64_t nvec = (bits & 15u) == 0 ? len / V : 0;
  for (int64_t base = threadIdx.x; base < nvec; base += int64_t{kThreads} * kUnroll)
    for (int d = 0; d < nd; ++d) {
      const uint4* s4 = reinterpret_cast<const uint4*>(srcs[d]);
      uint4* d4 = reinterpret_cast<uint4*>(dsts[d]);
      uint4 raw[kUnroll];
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) {
        const int64_t j = base + int64_t{r} * kThreads;
        if (j < nvec) raw[r] = s4[j];
      }
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) {
        const int64_t j = base + int64_t{r} * kThreads;
        if (j < nvec) d4[j] = raw[r];
      }
    }
  for (int d = 0; d < nd; ++d)
    for (int64_t i = nvec * V + threadIdx.x; i < len; i += kThreads) dsts[d][i] = srcs[d][i];
}

// A: this rank's contribution to piece q of every peer's chunk, into the peer's region me;
// release-flags (A, q) on each. Block-wide.
// With p.ts_spread the block alternates between the peers every kThreads * kUnroll vectors
// (scatter_range) instead of sending each peer its whole piece in turn, so that at any moment every
// peer's link carries this rank's writes, not the one peer that every block of the rank starts with.
template <class S>
__device__ __forceinline__ void ts_push(const Params& p, const Shared& sh, const S* in, int64_t mine, int64_t q) {
  const int n = p.nranks, me = p.rank;
  int64_t lo, len;
  ts_piece(p, q, &lo, &len);
  if (p.ts_spread) {
    S* dsts[kMaxLLRanks];
    const S* srcs[kMaxLLRanks];
    for (int d = 1; d < n; ++d) {
      const int j = (me + d) % n;
      dsts[d - 1] = reinterpret_cast<S*>(sh.pout[j]) + mine + lo;
      srcs[d - 1] = in + static_cast<int64_t>(j) * p.ts_chunk + lo;
    }
    scatter_range<S>(dsts, srcs, n - 1, len);
  } else {
    for (int d = 1; d < n; ++d) {
      const int j = (me + d) % n;
      copy_range<S, false>(reinterpret_cast<S*>(sh.pout[j]) + mine + lo, in + static_cast<int64_t>(j) * p.ts_chunk + lo, len);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int d = 1; d < n; ++d) sync::st_release_sys(ts_flag(p, sh.peer_base[(me + d) % n], me, 0, q), sh.k);
}

// B: piece q of chunk me, reduced in rank order into out; then (push) release-flags (B, q) on every
// peer ("my regions' piece q are read") and, where `tell_self`, on this rank's own inbox for the
// broadcasting blocks. Block-wide; false once the call failed.
template <class E, class Op>
__device__ __forceinline__ bool ts_reduce(const Params& p, Shared& sh, const typename E::S* in, typename E::S* out,
                                          int64_t mine, bool push, int64_t q, bool tell_self) {
  using S = typename E::S;
  const int n = p.nranks, me = p.rank;
  int64_t lo, len;
  ts_piece(p, q, &lo, &len);
  if (threadIdx.x == 0) {
    bool ok = true;
    for (int s = 0; ok && s < n; ++s)
      if (s != me && push) ok = wait_for(p, sh, ts_flag(p, p.site, s, 0, q), s, -1, mine + lo, kAtReduce);
    for (int s = 0; s < n; ++s)
      sh.src[s] = s == me ? static_cast<const void*>(in + mine + lo)
                  : push  ? static_cast<const void*>(out + static_cast<int64_t>(s) * p.ts_chunk + lo)
                          : static_cast<const void*>(reinterpret_cast<const S*>(sh.pin[s]) + mine + lo);
  }
  __syncthreads();
  if (sh.fail) return false;
  combine_range<E, Op>(out + mine + lo, static_cast<const S*>(sh.src[0]), reinterpret_cast<const S* const*>(sh.src + 1),
                       n - 1, nullptr, 0, len);
  __syncthreads();
  if (threadIdx.x == 0) {
    if (push)
      for (int d = 1; d < n; ++d) sync::st_release_sys(ts_flag(p, sh.peer_base[(me + d) % n], me, 1, q), sh.k);
    if (tell_self) sync::st_release_sys(ts_flag(p, p.site, me, 1, q), sh.k);
  }
  return true;
}

// C: piece q of chunk me into every peer's region me, once (push) every peer has read what this
// rank wrote there and, where `wait_self`, this rank's reducing block has finished the piece;
// release-flags (C, q). Block-wide; false once the call failed.
template <class E, class Op>
__device__ __forceinline__ bool ts_broadcast(const Params& p, Shared& sh, typename E::S* out, int64_t mine, bool push,
                                             int64_t q, bool wait_self) {
  using S = typename E::S;
  const int n = p.nranks, me = p.rank;
  int64_t lo, len;
  ts_piece(p, q, &lo, &len);
  if (threadIdx.x == 0) {
    bool ok = !wait_self || wait_for(p, sh, ts_flag(p, p.site, me, 1, q), me, -1, mine + lo, kAtBroadcast);
    int nd = 0;
    for (int d = 1; ok && d < n; ++d) {
      const int j = (me + d) % n;
      if (push) ok = wait_for(p, sh, ts_flag(p, p.site, j, 1, q), j, -1, mine + lo, kAtBroadcast);
      sh.dst[nd++] = reinterpret_cast<S*>(sh.pout[j]) + mine + lo;
    }
    sh.nd = nd;
  }
  __syncthreads();
  if (sh.fail) return false;
  combine_range<E, Op>(nullptr, out + mine + lo, nullptr, 0, reinterpret_cast<S* const*>(sh.dst), sh.nd, len);
  __syncthreads();
  if (threadIdx.x == 0)
    for (int d = 1; d < n; ++d) sync::st_release_sys(ts_flag(p, sh.peer_base[(me + d) % n], me, 2, q), sh.k);
  return true;
}

template <class E, class Op>
__global__ void __launch_bounds__(kThreads, 1) two_shot_kernel(const Params p) {
  using S = typename E::S;
  __shared__ Shared sh;
  __shared__ int push_mode;
  __shared__ S tail_out[kMaxTwoShotTail];
  const int tid = threadIdx.x, b = blockIdx.x, n = p.nranks, me = p.rank;
  uint32_t* blk_seq = reinterpret_cast<uint32_t*>(p.site + p.off_blk_seq);
  site_begin(p, sh, blk_seq + b);
  if (sh.fail) {
    if (b == 0 && tid == 0) fail_call(p, sh, 0, -1, -1, 0, 0, 0);
    return;
  }
  const S* in = static_cast<const S*>(p.in);
  S* out = static_cast<S*>(p.out);
  const int64_t C = p.ts_chunk, Q = p.ts_pieces;
  if (tid == 0) {
    sh.deadline = sync::globaltimer_ns() + p.timeout_ns;
    if (b == 0) publish_pointers(p, sh);
    bool ok = true, alias = p.in == p.out;
    for (int s = 0; ok && s < n; ++s) {
      if (s == me) continue;
      ok = get_pointers(p, sh, s, -1, 0);
      if (ok && sh.pin[s] == sh.pout[s]) alias = true;
    }
    push_mode = !alias && p.ts_pull == 0;
  }
  __syncthreads();
  if (sh.fail) goto done;
  {
    const bool push = push_mode != 0;
    const int64_t mine = static_cast<int64_t>(me) * C;  // chunk me's offset
    // The tail: block 0 reduces it in rank order from every rank's `in` and keeps it in shared
    // memory until the exit, since a peer may still read this rank's `in` (when in == out).
    const int64_t tail_off = static_cast<int64_t>(n) * C, tail = p.os_elems - tail_off;
    if (b == 0 && tail > 0) {
      for (int64_t i = tid; i < tail; i += kThreads) {
        typename E::A acc = E::load(ldcg_scalar<S>(reinterpret_cast<const S*>(me == 0 ? p.in : sh.pin[0]) + tail_off + i));
        for (int s = 1; s < n; ++s)
          acc = Op::apply(acc, E::load(ldcg_scalar<S>(reinterpret_cast<const S*>(s == me ? p.in : sh.pin[s]) + tail_off + i)));
        tail_out[i] = E::store(acc);
      }
    }
    // Roles: with R reducing blocks, blocks 0 .. M - 1 push and broadcast pieces b + i M, and
    // block M + r reduces pieces r + i R (in increasing order, so each waits only on pushes that
    // no broadcast waits behind); with R = 0 every block runs all three steps of pieces b + i G.
    const int R = p.ts_reducers, M = p.grid - R;
    if (b >= M) {
      for (int64_t q = b - M; q < Q; q += R)
        if (!ts_reduce<E, Op>(p, sh, in, out, mine, push, q, true)) goto done;
      goto done;  // nothing of this rank's result lands through a reducing block's exit
    }
    // Steps software-pipelined: push piece i, reduce piece i - 1 (no reducers), broadcast piece
    // i - 2, so that NVLink stays busy while other pieces reduce.
    const int64_t mq = (Q - b + M - 1) / M;  // this block's pieces: q = b + i M, i < mq
    for (int64_t i = 0; i < mq + 2; ++i) {
      if (push && i < mq) ts_push<S>(p, sh, in, mine, b + i * M);
      if (R == 0 && i >= 1 && i - 1 < mq && !ts_reduce<E, Op>(p, sh, in, out, mine, push, b + (i - 1) * M, false))
        goto done;
      if (i >= 2 && i - 2 < mq && !ts_broadcast<E, Op>(p, sh, out, mine, push, b + (i - 2) * M, R > 0)) goto done;
    }
    // Exit: every peer's final pieces of this block have landed here.
    if (tid == 0)
      for (int64_t i = 0; i < mq && !sh.fail; ++i)
        for (int s = 0; s < n && !sh.fail; ++s) {
          if (s == me) continue;
          int64_t lo, len;
          ts_piece(p, b + i * M, &lo, &len);
          wait_for(p, sh, ts_flag(p, p.site, s, 2, b + i * M), s, -1, static_cast<int64_t>(s) * C + lo, kAtExit);
        }
    __syncthreads();
    if (!sh.fail && b == 0)
      for (int64_t i = tid; i < tail; i += kThreads) out[tail_off + i] = tail_out[i];
  }
done:
  if (tid == 0) blk_seq[b] = sh.k;
}

}  // namespace
}  // namespace jax_blink::cuda
