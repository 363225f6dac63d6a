// Device side of the CUDA executor: the layouts it shares with the host (ErrorRecord, the plan's
// Unit / TreeRank records, Params), element types and ops, the combine loops, and the kernels
// (tree, LL, one-shot; two-shot in cuda/two_shot.cuh) with KernelFor(). The protocol they run is described at the top of
// cuda/executor.cu, the one translation unit that includes this file (hence the unnamed namespace).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/program.h"
#include "cuda/device_sync.cuh"
#include "cuda/executor.h"

namespace jax_blink::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;
constexpr int kMaxRanks = 64;
constexpr int kMaxDevices = 64;
constexpr int64_t kMaxUnits = 1 << 16;
constexpr int64_t kMaxPieceBytes = 4 << 20;
constexpr int kNumOps = 3;

// Error kinds (ErrorRecord::kind).
constexpr int kErrTimeout = 1, kErrAhead = 2, kErrAborted = 3, kErrMismatch = 4;
// Where a wait was (ErrorRecord::phase).
constexpr int kAtPointers = 0, kAtReduce = 1, kAtBroadcast = 2, kAtExit = 3, kAtOneShot = 4, kAtHost = 5;
// One-shot chunks: no smaller than this (flag cost), and the inbox keeps flags for at most
// region / kMinOneShotChunk chunks.
constexpr int64_t kMinOneShotChunk = 4096;
constexpr int kMaxLLRanks = 8;
constexpr int64_t kMaxCEChunks = 8;  // per call of a copy-engine host channel (see CreateSiteLocked)

// Per device, in host-mapped pinned memory: written by the first failing kernel, read by the host.
struct ErrorRecord {
  volatile int32_t ready;
  int32_t kind, device, rank, nranks, peer, tree, phase;
  int64_t chunk, elem_offset, comm_id, timeout_ms;
  uint32_t seq, observed;
};

struct Unit {
  int64_t off;   // first element
  int32_t len;   // elements
  int32_t tree;
};

struct TreeRank {  // tree t as rank r sees it
  int64_t seg_offset;
  int32_t parent;          // -1: root
  int32_t phases;
  int32_t kid_begin, kid_count;  // into kids[]: rank | (is_leaf << 16), ascending rank
  int32_t leaf;            // no children
  int32_t push_up;         // reduce phase, not the root, and the parent's only child: this rank
                           // pushes its reduce result into the parent's `out` (unless the
                           // parent's in == out in this call: then the parent pulls)
  int32_t kid_push;        // reduce phase and exactly one child: that child pushes into `out`
                           // (unless in == out in this call: then this rank pulls)
};

struct Params {
  uint8_t* site;  // this rank's site block
  const void* in;
  void* out;
  uint64_t timeout_ns;
  uint32_t* dev_claim;  // device memory: nonzero once a kernel on this device failed
  ErrorRecord* rec;     // host-mapped
  int64_t comm_id;
  int64_t chunk_elems;
  int64_t timeout_ms;
  uint32_t off_blk_seq, off_ptr_flag, off_abort, off_ptr_in, off_ptr_out, off_inbox;
  uint32_t off_units, off_trees, off_kids, off_gaps, off_peer_base;
  int32_t rank, nranks, nunits, ngaps, device, grid;
  // One-shot modes: this rank's staging block of the communicator (layout: peers' staging bases
  // [n] u64 at 0, call counters [stg_blocks] u32, flags [2][n-1][stg_max_chunks] u64, data
  // [2][n-1][stg_region] bytes).
  uint8_t* stg;
  uint64_t stg_off_seq, stg_off_flags, stg_off_data, stg_region;
  int64_t stg_max_chunks;
  int32_t stg_blocks;  // counters kept in step (the communicator's grid)
  uint32_t os_site;    // the call site's tag (low bits of comm_id)
  int64_t os_elems;    // the operand's elements
  int64_t os_chunk;    // kOneShot: elements per chunk
  // Mode::kLLBlocks (cuda/ll_blocks.cuh): kShapeReduceScatter or kShapeAllGather, and the bytes of
  // each rank's block (the operand is n of them).
  int32_t os_shape;
  int64_t os_block_bytes;
  // Mode::kTwoShot (cuda/two_shot.cuh): elements per rank's chunk, pieces per chunk (a multiple of
  // the grid), elements per 16 bytes; ts_pull: 1 runs pull mode in every call
  // (JAX_BLINK_TWOSHOT_MODE=pull), 0 pull only where an operand aliases its result. os_elems is the
  // operand's elements.
  int64_t ts_chunk, ts_pieces, ts_align;
  int32_t ts_pull;
  int32_t ts_reducers;  // blocks grid - ts_reducers .. grid - 1 only reduce (0: every block runs every step)
  int32_t ts_spread;    // 1: a block's pushes alternate between the peers (JAX_BLINK_TWOSHOT_PUSH=spread)
  // Mode::kHybrid: blocks grid .. grid + host_blocks - 1 move elements [host_off, host_off +
  // host_elems) through pinned host memory (2 ranks). The communicator's host channel: this
  // rank's outbox and the peer's, each two parity slots of host_slot bytes (device pointers of
  // mapped memory), and per rank a control block in device memory: call counters [hctl_blocks]
  // u32, then chunk flags [2][host_max_chunks] u32 (written by the peer).
  uint8_t* host_mine;
  const uint8_t* host_peer;
  uint32_t* hctl_mine;
  uint32_t* hctl_peer;
  int64_t host_off, host_elems, host_chunk, host_max_chunks;
  uint64_t host_slot;
  int32_t hctl_blocks;
  int32_t host_blocks;
  // Copy-engine host channel (host_ce): the copies and their flags are enqueued by Launch on side
  // streams; the host blocks only wait for each landed chunk (landed flags [2][host_max_chunks]
  // in the control block, after the counters) and reduce it from `stage` (device memory). kh is
  // the communicator's hybrid call number, counted on the host (so: no graph replay). On failure
  // they write `ready` (pinned host flags [2][host_max_chunks], what the side stream's copies wait
  // for) so that no stream waits forever.
  int32_t host_ce;
  uint32_t host_kh;
  const uint8_t* stage;
  uint32_t* ready_mine;
};

// ---------------------------------------------------------------------------------------------
// Element types (storage S, accumulator A) and ops.

struct EF32 { using S = float; using A = float;
  __device__ static A load(S v) { return v; } __device__ static S store(A a) { return a; } };
struct EF64 { using S = double; using A = double;
  __device__ static A load(S v) { return v; } __device__ static S store(A a) { return a; } };
struct ES32 { using S = int32_t; using A = int32_t;
  __device__ static A load(S v) { return v; } __device__ static S store(A a) { return a; } };
struct ES64 { using S = int64_t; using A = int64_t;
  __device__ static A load(S v) { return v; } __device__ static S store(A a) { return a; } };
struct EBF16 { using S = uint16_t; using A = float;
  __device__ static A load(S v) { return __uint_as_float(static_cast<uint32_t>(v) << 16); }
  __device__ static S store(A a) {  // round to nearest even, NaN stays quiet NaN (as ml_dtypes)
    uint32_t u = __float_as_uint(a);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<S>((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<S>(u >> 16);
  } };
struct EF16 { using S = uint16_t; using A = float;
  __device__ static A load(S v) { return __half2float(__ushort_as_half(v)); }
  __device__ static S store(A a) { return __half_as_ushort(__float2half_rn(a)); } };

// numpy's semantics, as the CPU executor: NaN propagates, ties keep the first operand.
struct OpSum { template <class A> __device__ static A apply(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else { return a + b; } } };
struct OpMax { template <class A> __device__ static A apply(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) return (a >= b || a != a) ? a : b;
  else return a >= b ? a : b; } };
struct OpMin { template <class A> __device__ static A apply(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) return (a <= b || a != a) ? a : b;
  else return a <= b ? a : b; } };

// Loads that bypass L1: ld.global.cg (peer data), or with kCv ld.global.cv (pinned host memory
// that another GPU wrote: a line of it cached on this GPU from an earlier call is never used).
template <bool kCv, class T>
__device__ __forceinline__ T ld_bypass(const T* p) {
  if constexpr (kCv) return __ldcv(p);
  else return __ldcg(p);
}
template <class S, bool kCv = false>
__device__ __forceinline__ S ldcg_scalar(const S* p) {
  if constexpr (sizeof(S) == 8) {
    long long v = ld_bypass<kCv>(reinterpret_cast<const long long*>(p));
    S s; memcpy(&s, &v, 8); return s;
  } else if constexpr (sizeof(S) == 4) {
    int v = ld_bypass<kCv>(reinterpret_cast<const int*>(p));
    S s; memcpy(&s, &v, 4); return s;
  } else {
    unsigned short v = ld_bypass<kCv>(reinterpret_cast<const unsigned short*>(p));
    S s; memcpy(&s, &v, 2); return s;
  }
}

template <class S>
struct Vec {
  static constexpr int N = 16 / sizeof(S);
  S v[N];
};
template <class S>
__device__ __forceinline__ Vec<S> as_vec(uint4 u) { Vec<S> r; memcpy(&r, &u, 16); return r; }
template <class S>
__device__ __forceinline__ uint4 as_u4(const Vec<S>& v) { uint4 u; memcpy(&u, &v, 16); return u; }

// Elements of S before the first 16-byte boundary of a range whose pointers all sit `mis` bytes
// past one (every rank's buffers start aligned, so a piece that starts mid-vector, as 3 ranks'
// reduce-scatter chunks do, starts at the same offset in each): the scalar head of the movers below.
template <class S>
__device__ __forceinline__ int64_t head_to_16(uintptr_t mis, int64_t len) {
  const int64_t to16 = static_cast<int64_t>((16u - mis) & 15u) / static_cast<int64_t>(sizeof(S));
  return len < to16 ? len : to16;
}

// The one data mover: acc = in[i] op srcs[0][i] op srcs[1][i] ... (srcs in order); then
// out[i] = acc (when out != nullptr) and dsts[d][i] = acc for every d (peers' buffers: the push).
// Block-wide over i < len. Every load is ld.global.cg: `in` and the sources may be a peer's
// buffer or this rank's buffer written by a peer over NVLink, never to be served from a stale L1
// line. 16-byte vectors when every pointer has the same offset from 16 bytes (a scalar head up
// to the boundary, then vectors, then a scalar tail), fully scalar otherwise. out may alias in or
// a source (each element is read before it is written, by the same thread). kCv: every load is
// ld.global.cv instead (the host channel's pinned memory).
template <class E, class Op, bool kCv = false>
__device__ void combine_range(typename E::S* out, const typename E::S* in, const typename E::S* const* srcs,
                              int nk, typename E::S* const* dsts, int nd, int64_t len) {
  using S = typename E::S;
  using A = typename E::A;
  constexpr int V = Vec<S>::N;
  const uintptr_t mis = reinterpret_cast<uintptr_t>(in) & 15u;  // shared by every pointer: head_to_16
  uintptr_t diff = out != nullptr ? (reinterpret_cast<uintptr_t>(out) & 15u) ^ mis : 0;
  for (int j = 0; j < nk; ++j) diff |= (reinterpret_cast<uintptr_t>(srcs[j]) & 15u) ^ mis;
  for (int j = 0; j < nd; ++j) diff |= (reinterpret_cast<uintptr_t>(dsts[j]) & 15u) ^ mis;
  const bool common = diff == 0 && mis % sizeof(S) == 0;
  const int64_t head = common ? head_to_16<S>(mis, len) : 0;
  const int64_t nvec = common ? (len - head) / V : 0;
  const uint4* in4 = reinterpret_cast<const uint4*>(in + head);
  uint4* out4 = out != nullptr ? reinterpret_cast<uint4*>(out + head) : nullptr;
  for (int64_t base = threadIdx.x; base < nvec; base += int64_t{kThreads} * kUnroll) {
    uint4 res[kUnroll];
    if (nk == 0) {  // a copy: no conversion (bit-exact, also for NaN payloads)
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) {
        const int64_t j = base + int64_t{r} * kThreads;
        if (j < nvec) res[r] = ld_bypass<kCv>(in4 + j);
      }
    } else {
      A acc[kUnroll][V];
      uint4 raw[kUnroll];
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) {
        const int64_t j = base + int64_t{r} * kThreads;
        if (j < nvec) raw[r] = ld_bypass<kCv>(in4 + j);
      }
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) {
        Vec<S> x = as_vec<S>(raw[r]);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[r][e] = E::load(x.v[e]);
      }
      for (int k = 0; k < nk; ++k) {
        const uint4* s4 = reinterpret_cast<const uint4*>(srcs[k] + head);
#pragma unroll
        for (int r = 0; r < kUnroll; ++r) {
          const int64_t j = base + int64_t{r} * kThreads;
          if (j < nvec) raw[r] = ld_bypass<kCv>(s4 + j);
        }
#pragma unroll
        for (int r = 0; r < kUnroll; ++r) {
          Vec<S> x = as_vec<S>(raw[r]);
#pragma unroll
          for (int e = 0; e < V; ++e) acc[r][e] = Op::apply(acc[r][e], E::load(x.v[e]));
        }
      }
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) {
        Vec<S> x;
#pragma unroll
        for (int e = 0; e < V; ++e) x.v[e] = E::store(acc[r][e]);
        res[r] = as_u4<S>(x);
      }
    }
    for (int d = 0; d < nd; ++d) {
      uint4* d4 = reinterpret_cast<uint4*>(dsts[d] + head);
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) {
        const int64_t j = base + int64_t{r} * kThreads;
        if (j < nvec) d4[j] = res[r];
      }
    }
    if (out4 != nullptr) {
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) {
        const int64_t j = base + int64_t{r} * kThreads;
        if (j < nvec) out4[j] = res[r];
      }
    }
  }
  // The scalar elements: the head [0, head), then the tail [head + nvec V, len).
  for (int64_t t = threadIdx.x; t < len - nvec * V; t += kThreads) {
    const int64_t i = t < head ? t : t + nvec * V;
    S v = ldcg_scalar<S, kCv>(in + i);
    if (nk > 0) {
      A a = E::load(v);
      for (int k = 0; k < nk; ++k) a = Op::apply(a, E::load(ldcg_scalar<S, kCv>(srcs[k] + i)));
      v = E::store(a);
    }
    for (int d = 0; d < nd; ++d) dsts[d][i] = v;
    if (out != nullptr) out[i] = v;
  }
}

// dst[i] = src[i] for i < len (block-wide); kPeer: src is a peer's buffer (ld.global.cg).
template <class S, bool kPeer>
__device__ void copy_range(S* dst, const S* src, int64_t len) {
  constexpr int V = 16 / sizeof(S);
  const uintptr_t mis = reinterpret_cast<uintptr_t>(src) & 15u;
  const bool common = (reinterpret_cast<uintptr_t>(dst) & 15u) == mis && mis % sizeof(S) == 0;
  const int64_t head = common ? head_to_16<S>(mis, len) : 0;
  const int64_t nvec = common ? (len - head) / V : 0;
  const uint4* s4 = reinterpret_cast<const uint4*>(src + head);
  uint4* d4 = reinterpret_cast<uint4*>(dst + head);
  for (int64_t base = threadIdx.x; base < nvec; base += int64_t{kThreads} * kUnroll) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) {
      const int64_t j = base + int64_t{r} * kThreads;
      if (j < nvec) raw[r] = kPeer ? __ldcg(s4 + j) : s4[j];
    }
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) {
      const int64_t j = base + int64_t{r} * kThreads;
      if (j < nvec) d4[j] = raw[r];
    }
  }
  for (int64_t t = threadIdx.x; t < len - nvec * V; t += kThreads) {
    const int64_t i = t < head ? t : t + nvec * V;
    dst[i] = kPeer ? ldcg_scalar(src + i) : src[i];
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel.

struct Shared {
  uint32_t k;       // this call's number
  int fail;         // set by thread 0 when this block stops
  uint64_t have;    // peers whose pointers this block holds
  uint64_t deadline;
  int nk, nd, work, up;  // the current step: sources, remote destinations, anything to move, push up
  uint32_t gave_up[kMaxRanks];  // one-shot prologue: each peer's abort marker (0: it has not given up)
  void* outp;            // the current step's local destination (nullptr: none)
  const uint8_t* pin[kMaxRanks];
  uint8_t* pout[kMaxRanks];
  uint8_t* peer_base[kMaxRanks];
  uint8_t* stg_peer[kMaxRanks];  // one-shot: the peers' staging blocks
  const void* src[kMaxRanks];  // sources of the current step
  void* dst[kMaxRanks];        // peers' buffers the current step writes (pushes)
};

__device__ __forceinline__ uint32_t* inbox_at(const Params& p, uint8_t* base, int src, int phase, int u) {
  return reinterpret_cast<uint32_t*>(base + p.off_inbox) +
         (static_cast<int64_t>(src) * 2 + phase) * p.nunits + u;
}

// Thread 0: this rank gives up call k. Abort markers first (peers waiting on it stop at once),
// then the device's error record if this is the device's first failure.
__device__ void fail_call(const Params& p, Shared& sh, int kind, int peer, int tree, int64_t elem_off,
                          int at, uint32_t observed) {
  sh.fail = 1;
  for (int dst = 0; dst < p.nranks; ++dst)
    if (dst != p.rank)
      sync::st_relaxed_sys(reinterpret_cast<uint32_t*>(sh.peer_base[dst] + p.off_abort) + p.rank,
                           sh.k == 0 ? 1u : sh.k);
  __threadfence_system();
  if (kind == 0) return;  // the device was stopped by an earlier failure: it holds the record
  if (atomicCAS(p.dev_claim, 0u, 1u) != 0u) return;
  ErrorRecord* r = p.rec;
  const TreeRank* trees = reinterpret_cast<const TreeRank*>(p.site + p.off_trees);
  r->kind = kind;
  r->device = p.device;
  r->rank = p.rank;
  r->nranks = p.nranks;
  r->peer = peer;
  r->tree = tree;
  r->phase = at;
  r->elem_offset = elem_off;
  r->chunk = (tree >= 0 && p.chunk_elems > 0) ? (elem_off - trees[tree].seg_offset) / p.chunk_elems : -1;
  r->comm_id = p.comm_id;
  r->timeout_ms = p.timeout_ms;
  r->seq = sh.k;
  r->observed = observed;
  __threadfence_system();
  r->ready = 1;
  __threadfence_system();
}

// Thread 0: wait until `flag` == target. Returns false (after fail_call) when the call must stop.
__device__ bool wait_for_value(const Params& p, Shared& sh, const uint32_t* flag, uint32_t target, int src,
                               int tree, int64_t elem_off, int at) {
  const uint32_t* abort_word = reinterpret_cast<const uint32_t*>(p.site + p.off_abort) + src;
  uint32_t observed = 0;
  int st = sync::wait_flag(flag, target, sh.deadline, abort_word, p.dev_claim, &observed);
  // A producer that gave up may have published this flag (or its pointers) before it did: its
  // buffers are not to be trusted once its kernel has left. Checked after every wait (local).
  if (st == sync::kWaitOk && sync::ld_relaxed_sys(abort_word) != 0u) st = sync::kWaitAborted;
  if (st == sync::kWaitOk) {
    sh.deadline = sync::globaltimer_ns() + p.timeout_ns;  // the budget is per wait
    return true;
  }
  int kind = 0;
  if (st == sync::kWaitTimeout) kind = kErrTimeout;
  else if (st == sync::kWaitAhead) kind = kErrAhead;
  else if (st == sync::kWaitAborted) { kind = kErrAborted; observed = sync::ld_relaxed_sys(abort_word); }
  fail_call(p, sh, kind, src, tree, elem_off, at, observed);  // kWaitStopped: kind 0
  return false;
}

// Thread 0: wait until `flag` == this call's number k.
__device__ bool wait_for(const Params& p, Shared& sh, const uint32_t* flag, int src, int tree, int64_t elem_off,
                         int at) {
  return wait_for_value(p, sh, flag, sh.k, src, tree, elem_off, at);
}

// Thread 0: make `src`'s pointers of this call available in sh.pin / sh.pout. Two slots per
// peer, by the parity of the call number: a neighbour in a tree is never more than one call
// ahead of this rank (see the header), so slot k & 1 still holds call k's pointers.
__device__ bool get_pointers(const Params& p, Shared& sh, int src, int tree, int64_t elem_off) {
  if ((sh.have >> src) & 1u) return true;
  const int slot = 2 * src + static_cast<int>(sh.k & 1u);
  const uint32_t* flag = reinterpret_cast<const uint32_t*>(p.site + p.off_ptr_flag) + slot;
  if (!wait_for(p, sh, flag, src, tree, elem_off, kAtPointers)) return false;
  sh.pin[src] = reinterpret_cast<const uint8_t*>(
      sync::ld_relaxed_sys_u64(reinterpret_cast<const uint64_t*>(p.site + p.off_ptr_in) + slot));
  sh.pout[src] = reinterpret_cast<uint8_t*>(
      sync::ld_relaxed_sys_u64(reinterpret_cast<const uint64_t*>(p.site + p.off_ptr_out) + slot));
  sh.have |= uint64_t{1} << src;
  return true;
}

__device__ __forceinline__ void signal(const Params& p, Shared& sh, int dst, int phase, int u) {
  sync::st_release_sys(inbox_at(p, sh.peer_base[dst], p.rank, phase, u), sh.k);
}

// Copy-engine variant (host_ce): the side streams move the chunks (see Launch); this block waits
// for each of its chunks to land in `stage` and reduces it. If it stops early it releases the
// side stream's waits on its chunks (ready flags = kh), so that the call ends, failed, not hung.
template <class E, class Op>
__device__ void host_channel_ce(const Params& p, Shared& sh, int hb) {
  using S = typename E::S;
  const int H = p.host_blocks, tid = threadIdx.x, me = p.rank, peer = 1 - me;
  const uint32_t kh = p.host_kh;
  const int par = static_cast<int>(kh & 1u);
  const int64_t C = p.host_chunk, total = p.host_elems;
  const int64_t nch = (total + C - 1) / C;
  const S* in = static_cast<const S*>(p.in) + p.host_off;
  S* out = static_cast<S*>(p.out) + p.host_off;
  const S* theirs = reinterpret_cast<const S*>(p.stage);
  const uint32_t* landed = p.hctl_mine + p.hctl_blocks + par * p.host_max_chunks;
  int64_t c = hb;
  for (; c < nch && !sh.fail; c += H) {
    const int64_t lo = c * C, len = min(C, total - lo);
    if (tid == 0) wait_for_value(p, sh, landed + c, kh, peer, -1, p.host_off + lo, kAtHost);
    __syncthreads();
    if (sh.fail) break;
    const S* first = me == 0 ? in + lo : theirs + lo;
    const S* second = me == 0 ? theirs + lo : in + lo;
    combine_range<E, Op, false>(out + lo, first, &second, 1, nullptr, 0, len);
    __syncthreads();
  }
  if (tid == 0 && sh.fail)
    for (int64_t r = hb; r < nch; r += H) sync::st_release_sys(p.ready_mine + par * p.host_max_chunks + r, kh);
}

// Mode::kHybrid, host block hb of H (2 ranks): chunks hb, hb + H, ... of the slice [host_off,
// host_off + host_elems). The host channel belongs to the communicator (one outbox per rank for
// all its hybrid sites), and so does its call number kh: the number of hybrid calls on this
// communicator so far, kept per block in the control block and moved in lockstep (block 0 also
// moves the counters of the blocks this site does not use). Send chunk c: copy this rank's `in`
// into its outbox (pinned host memory, slot kh & 1), then st.release.sys kh into the chunk's flag
// in the peer's control block (over NVLink; the release orders the block's PCIe writes before
// it). Receive chunk c: wait for the peer's flag here, then out = rank 0's op rank 1's (rank
// order: both ranks round alike), reading the peer's outbox with ld.global.cv. A block sends
// c + H before it waits for c, so that both directions of the PCIe links stay busy. Two slots
// suffice for the reason the one-shot inbox's do (see the header): this rank overwrites slot
// kh & 1 in hybrid call kh + 2 only after its call kh + 1 received the peer's chunks of that
// call, which the peer sends only after its call kh (the last reader of the slot) finished; by
// the same argument a flag is never overwritten before its waiter has seen it.
template <class E, class Op>
__device__ void host_channel(const Params& p, Shared& sh, int hb) {
  if (p.host_ce) {
    host_channel_ce<E, Op>(p, sh, hb);
    return;
  }
  using S = typename E::S;
  const int H = p.host_blocks, tid = threadIdx.x, me = p.rank, peer = 1 - me;
  const uint32_t kh = p.hctl_mine[hb] + 1;  // read by every thread (the same value): local, stream-ordered
  const int par = static_cast<int>(kh & 1u);
  const int64_t C = p.host_chunk, total = p.host_elems;
  const int64_t nch = (total + C - 1) / C;
  const S* in = static_cast<const S*>(p.in) + p.host_off;
  S* out = static_cast<S*>(p.out) + p.host_off;
  S* mine = reinterpret_cast<S*>(p.host_mine + par * p.host_slot);
  const S* theirs = reinterpret_cast<const S*>(p.host_peer + par * p.host_slot);
  const uint32_t* flag_here = p.hctl_mine + p.hctl_blocks + par * p.host_max_chunks;
  uint32_t* flag_there = p.hctl_peer + p.hctl_blocks + par * p.host_max_chunks;
  auto send = [&](int64_t c) {
    const int64_t lo = c * C, len = min(C, total - lo);
    copy_range<S, false>(mine + lo, in + lo, len);
    __syncthreads();  // every thread's stores before the release
    if (tid == 0) sync::st_release_sys(flag_there + c, kh);
  };
  auto receive = [&](int64_t c) {
    const int64_t lo = c * C, len = min(C, total - lo);
    if (tid == 0) wait_for_value(p, sh, flag_here + c, kh, peer, -1, p.host_off + lo, kAtHost);
    __syncthreads();
    if (sh.fail) return false;
    const S* first = me == 0 ? in + lo : theirs + lo;
    const S* second = me == 0 ? theirs + lo : in + lo;
    combine_range<E, Op, true>(out + lo, first, &second, 1, nullptr, 0, len);
    __syncthreads();  // every warp has read sh.fail before thread 0's next wait may set it
    return true;
  };
  int64_t c = hb;
  if (c < nch) send(c);
  for (; c < nch; c += H) {
    if (c + H < nch) send(c + H);
    if (!receive(c)) break;
  }
  __syncthreads();  // every thread has read kh
  if (tid == 0) {  // the next hybrid call on this stream sees it (stream order), failed or not
    p.hctl_mine[hb] = kh;
    if (hb == 0)
      for (int j = H; j < p.hctl_blocks; ++j) p.hctl_mine[j] = kh;
  }
}

// Every thread of a site kernel (tree, two-shot): this call's number k (the block's counter + 1),
// the peers' site blocks and whether the device is stopped, into `sh`. The words are all loaded
// before any is used: one memory round trip (as oneshot_begin). Ends with __syncthreads().
__device__ __forceinline__ void site_begin(const Params& p, Shared& sh, const uint32_t* seq_word) {
  const int tid = threadIdx.x;
  const uint64_t* peer_base = reinterpret_cast<const uint64_t*>(p.site + p.off_peer_base);
  const uint64_t pb = tid < p.nranks ? peer_base[tid] : 0;
  const uint32_t seq = tid == 0 ? *seq_word : 0u;
  const uint32_t claim = tid == 0 ? sync::ld_relaxed_sys_snapshot(p.dev_claim) : 0u;
  if (tid < p.nranks) sh.peer_base[tid] = reinterpret_cast<uint8_t*>(pb);
  if (tid == 0) {
    sh.have = 0;
    sh.k = seq + 1;
    sh.fail = claim != 0u;
  }
  __syncthreads();
}

// Thread 0 of block 0: this call's (in, out) into every peer's pointer table (slot k & 1), then
// the release flag: a peer that sees it knows this rank's kernel of call k runs (get_pointers).
__device__ void publish_pointers(const Params& p, const Shared& sh) {
  const int slot = 2 * p.rank + static_cast<int>(sh.k & 1u);
  for (int dst = 0; dst < p.nranks; ++dst) {
    if (dst == p.rank) continue;
    uint8_t* base = sh.peer_base[dst];
    sync::st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(base + p.off_ptr_in) + slot, reinterpret_cast<uint64_t>(p.in));
    sync::st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(base + p.off_ptr_out) + slot, reinterpret_cast<uint64_t>(p.out));
    sync::st_release_sys(reinterpret_cast<uint32_t*>(base + p.off_ptr_flag) + slot, sh.k);
  }
}

template <class E, class Op>
__global__ void __launch_bounds__(kThreads, 1) collective_kernel(const Params p) {
  using S = typename E::S;
  __shared__ Shared sh;
  const int tid = threadIdx.x;
  const int b = blockIdx.x;
  uint32_t* blk_seq = reinterpret_cast<uint32_t*>(p.site + p.off_blk_seq);
  const Unit* units = reinterpret_cast<const Unit*>(p.site + p.off_units);
  const TreeRank* trees = reinterpret_cast<const TreeRank*>(p.site + p.off_trees);
  const int32_t* kids = reinterpret_cast<const int32_t*>(p.site + p.off_kids);
  site_begin(p, sh, blk_seq + b);
  if (sh.fail) {  // the device is stopped: tell the peers, do nothing, keep the counter
    if (b == 0 && tid == 0) fail_call(p, sh, 0, -1, -1, 0, 0, 0);
    if (b >= p.grid && p.host_ce) host_channel_ce<E, Op>(p, sh, b - p.grid);  // releases the side stream
    return;
  }
  const S* in = static_cast<const S*>(p.in);
  S* out = static_cast<S*>(p.out);
  const bool alias = p.in == p.out;
  if (tid == 0) {
    sh.deadline = sync::globaltimer_ns() + p.timeout_ns;
    if (b == 0) publish_pointers(p, sh);
  }

  // Elements outside every segment: out = in, each gap split over the grid.
  if (!alias) {
    const int64_t* gaps = reinterpret_cast<const int64_t*>(p.site + p.off_gaps);
    for (int g = 0; g < p.ngaps; ++g) {
      const int64_t off = gaps[2 * g], len = gaps[2 * g + 1];
      const int64_t per = ((len + p.grid - 1) / p.grid + 7) & ~int64_t{7};
      const int64_t lo = per * b < len ? per * b : len;
      const int64_t hi = lo + per < len ? lo + per : len;
      if (hi > lo) copy_range<S, false>(out + off + lo, in + off + lo, hi - lo);
    }
  }

  // Mode::kHybrid: the blocks past the trees' grid run the host channel, and only that.
  if (b >= p.grid) {
    host_channel<E, Op>(p, sh, b - p.grid);
    goto done;
  }

  // Reduce pass: step (R, u).
  for (int u = b; u < p.nunits; u += p.grid) {
    const Unit un = units[u];
    const TreeRank tr = trees[un.tree];
    if (!(tr.phases & kPhaseReduce)) continue;
    const bool bcast = (tr.phases & kPhaseBroadcast) != 0;
    const bool root = tr.parent < 0;
    // A leaf that its parent always pulls (the parent has several children): nothing to do here,
    // the parent reads `in` in place; `out` gets the broadcast.
    if (tr.leaf && !root && bcast && !tr.push_up) continue;
    const bool kid_pushes = tr.kid_push && !alias;  // the only child writes into our `out`
    if (tid == 0) {
      bool ok = true;
      int nk = 0, nd = 0;
      bool up = false;
      if (!root && tr.push_up) {  // push unless the parent's in == out this call
        ok = get_pointers(p, sh, tr.parent, un.tree, un.off);
        up = ok && sh.pin[tr.parent] != sh.pout[tr.parent];
      }
      if (ok && kid_pushes) {
        const int kid = kids[tr.kid_begin] & 0xffff;
        ok = wait_for(p, sh, inbox_at(p, p.site, kid, 0, u), kid, un.tree, un.off, kAtReduce);
        sh.src[nk++] = out + un.off;  // the child's result, landed in our `out`
      } else {
        for (int i = 0; ok && i < tr.kid_count; ++i) {
          const int kid = kids[tr.kid_begin + i] & 0xffff;
          const bool kid_leaf = (kids[tr.kid_begin + i] >> 16) != 0;
          ok = get_pointers(p, sh, kid, un.tree, un.off);
          if (ok && !kid_leaf) ok = wait_for(p, sh, inbox_at(p, p.site, kid, 0, u), kid, un.tree, un.off, kAtReduce);
          if (ok) sh.src[nk++] = (kid_leaf ? sh.pin[kid] : sh.pout[kid]) + un.off * sizeof(S);
        }
      }
      if (ok && root && bcast)  // final now: push it into every child's `out`
        for (int i = 0; ok && i < tr.kid_count; ++i) {
          const int kid = kids[tr.kid_begin + i] & 0xffff;
          ok = get_pointers(p, sh, kid, un.tree, un.off);
          if (ok) sh.dst[nd++] = sh.pout[kid] + un.off * sizeof(S);
        }
      if (ok && up) sh.dst[nd++] = sh.pout[tr.parent] + un.off * sizeof(S);
      // Local `out`: the root's result; every rank's in a reduce-only tree (the semantics); a
      // non-leaf's partial result when its parent pulls it. Not a copy of `in` onto itself.
      const bool local = root || !bcast || (!up && !tr.leaf);
      sh.outp = (local && !(alias && nk == 0)) ? static_cast<void*>(out + un.off) : nullptr;
      sh.nk = nk;
      sh.nd = nd;
      sh.up = up;
      sh.work = sh.outp != nullptr || nd > 0;
    }
    __syncthreads();
    if (sh.fail) goto done;
    if (sh.work)
      combine_range<E, Op>(static_cast<S*>(sh.outp), in + un.off, reinterpret_cast<const S* const*>(sh.src), sh.nk,
                           reinterpret_cast<S* const*>(sh.dst), sh.nd, un.len);
    __syncthreads();  // every thread's stores (and its reads of sh.*) before the release
    if (tid == 0) {
      if (!root && (sh.up || !tr.leaf)) signal(p, sh, tr.parent, 0, u);  // pushed / partial ready
      if (root && bcast)
        for (int i = 0; i < tr.kid_count; ++i) signal(p, sh, kids[tr.kid_begin + i] & 0xffff, 1, u);
      if (!bcast && !kid_pushes)  // reduce-only: "done reading you" to the children we pulled
        for (int i = 0; i < tr.kid_count; ++i) signal(p, sh, kids[tr.kid_begin + i] & 0xffff, 0, u);
    }
  }

  // Broadcast pass: step (B, u). The parent pushed into our `out`; pass it on to the children.
  for (int u = b; u < p.nunits; u += p.grid) {
    const Unit un = units[u];
    const TreeRank tr = trees[un.tree];
    if (!(tr.phases & kPhaseBroadcast)) continue;
    const bool root = tr.parent < 0;
    if (root && (tr.phases & kPhaseReduce)) continue;  // pushed in its reduce step
    if (tid == 0) {
      bool ok = root || wait_for(p, sh, inbox_at(p, p.site, tr.parent, 1, u), tr.parent, un.tree, un.off, kAtBroadcast);
      int nd = 0;
      for (int i = 0; ok && i < tr.kid_count; ++i) {
        const int kid = kids[tr.kid_begin + i] & 0xffff;
        ok = get_pointers(p, sh, kid, un.tree, un.off);
        if (ok) sh.dst[nd++] = sh.pout[kid] + un.off * sizeof(S);
      }
      // The root of a broadcast-only tree: out = in (and in goes to the children).
      sh.outp = (root && !alias) ? static_cast<void*>(out + un.off) : nullptr;
      sh.nd = nd;
      sh.work = sh.outp != nullptr || nd > 0;
    }
    __syncthreads();
    if (sh.fail) goto done;
    if (sh.work)
      combine_range<E, Op>(static_cast<S*>(sh.outp), (root ? in : out) + un.off, nullptr, 0,
                           reinterpret_cast<S* const*>(sh.dst), sh.nd, un.len);
    __syncthreads();
    if (tid == 0)
      for (int i = 0; i < tr.kid_count; ++i) signal(p, sh, kids[tr.kid_begin + i] & 0xffff, 1, u);
  }

  // Exit pass (thread 0): nobody reads this rank's buffers any more. Only a child of a
  // reduce-only tree that its parent pulled waits here (for the parent's "done reading you");
  // with a broadcast phase the broadcast it waited for came after every read of its buffers.
  if (tid == 0) {
    for (int u = b; u < p.nunits && !sh.fail; u += p.grid) {
      const Unit un = units[u];
      const TreeRank tr = trees[un.tree];
      if ((tr.phases & kPhaseBroadcast) || tr.parent < 0) continue;
      const bool up = tr.push_up && sh.pin[tr.parent] != sh.pout[tr.parent];  // fetched in (R, u)
      if (!up) wait_for(p, sh, inbox_at(p, p.site, tr.parent, 0, u), tr.parent, un.tree, un.off, kAtExit);
    }
  }
done:
  if (tid == 0) blk_seq[b] = sh.k;  // the next kernel on this stream sees it (stream order)
}

// ---------------------------------------------------------------------------------------------
// One-shot kernels (Mode::kLL, Mode::kOneShot): see "One-shot all-reduce" at the top.

// The inbox slot that rank `src` owns on rank `dst` (n-1 per parity: none for itself).
__device__ __forceinline__ int inbox_slot(int src, int dst) { return src < dst ? src : src - 1; }

__device__ __forceinline__ uint8_t* stg_data(const Params& p, uint8_t* base, int par, int slot) {
  return base + p.stg_off_data + (static_cast<uint64_t>(par) * (p.nranks - 1) + slot) * p.stg_region;
}
__device__ __forceinline__ uint64_t* stg_flags(const Params& p, uint8_t* base, int par, int slot) {
  return reinterpret_cast<uint64_t*>(base + p.stg_off_flags) +
         (static_cast<int64_t>(par) * (p.nranks - 1) + slot) * p.stg_max_chunks;
}

// Prologue of both one-shot kernels: this call's number from the communicator's counter, the
// peers' site and staging bases. Returns false when the device is stopped (the call is skipped,
// the peers are told).
__device__ bool oneshot_begin(const Params& p, Shared& sh) {
  const int tid = threadIdx.x;
  // Every word of the prologue is loaded before any of them is used: one memory round trip in
  // all (thread i < n: rank i's site and staging bases and its abort marker here; thread 0: the
  // call counter, the device claim, the clock), where storing each into shared memory before
  // the next load cost one trip per word (benchmarks/NOTES.md, change 7).
  const bool peer = tid < p.nranks;
  const uint64_t pb = peer ? reinterpret_cast<const uint64_t*>(p.site + p.off_peer_base)[tid] : 0;
  const uint64_t sp = peer ? reinterpret_cast<const uint64_t*>(p.stg)[tid] : 0;
  const uint32_t ab = peer && tid != p.rank
                          ? sync::ld_relaxed_sys_snapshot(reinterpret_cast<const uint32_t*>(p.site + p.off_abort) + tid)
                          : 0u;
  uint32_t seq = 0, claim = 0;
  uint64_t now = 0;
  if (tid == 0) {
    seq = reinterpret_cast<const uint32_t*>(p.stg + p.stg_off_seq)[blockIdx.x];
    claim = sync::ld_relaxed_sys_snapshot(p.dev_claim);
    now = sync::globaltimer_ns();
  }
  if (peer) {
    sh.peer_base[tid] = reinterpret_cast<uint8_t*>(pb);
    sh.stg_peer[tid] = reinterpret_cast<uint8_t*>(sp);
    sh.gave_up[tid] = ab;  // a peer that gave up already (this call or before): fail_if_a_peer_gave_up
  }
  if (tid == 0) {
    sh.k = seq + 1;
    sh.fail = claim != 0u;
    sh.deadline = now + p.timeout_ns;
  }
  __syncthreads();
  if (sh.fail) {
    if (blockIdx.x == 0 && threadIdx.x == 0) fail_call(p, sh, 0, -1, -1, 0, 0, 0);
    return false;
  }
  return true;
}

// At the end, every thread: the communicator's counters move to this call, all of them (a later
// one-shot kernel may run a larger grid); block 0 writes the other blocks' over its threads.
__device__ void oneshot_end(const Params& p, const Shared& sh) {
  uint32_t* seq = reinterpret_cast<uint32_t*>(p.stg + p.stg_off_seq);
  if (threadIdx.x == 0) seq[blockIdx.x] = sh.k;
  if (blockIdx.x == 0)
    for (int j = gridDim.x + threadIdx.x; j < p.stg_blocks; j += kThreads) seq[j] = sh.k;
}

// Every thread, at the end of an LL kernel: a peer that gave up (on this call or before) may have
// written its lines first, so this call fails too, as the tree kernel's waits do, and the ranks
// never disagree silently. Its abort marker was read in the prologue (sh.gave_up), not here: one
// memory round trip less at the end of every call. A peer that gives up while this call runs is
// seen by the waits (ll_wait) or by the next call, as one that gave up just after a read here
// always was.
__device__ void fail_if_a_peer_gave_up(const Params& p, Shared& sh) {
  __syncthreads();
  if (threadIdx.x == 0 && !sh.fail)
    for (int src = 0; src < p.nranks; ++src)
      if (src != p.rank && sh.gave_up[src] != 0u) {
        fail_call(p, sh, kErrAborted, src, -1, 0, kAtOneShot, sh.gave_up[src]);
        break;
      }
}

// 8 bytes of `src` at line i (bytes [8i, 8i + 8) cut at `bytes`, zeros past the end).
__device__ __forceinline__ uint2 load_line(const uint8_t* src, int64_t i, int64_t bytes, bool aligned8) {
  const int64_t at = 8 * i;
  if (aligned8 && at + 8 <= bytes) return *reinterpret_cast<const uint2*>(src + at);
  uint8_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int j = 0; j < 8 && at + j < bytes; ++j) t[j] = src[at + j];
  uint2 v;
  memcpy(&v, t, 8);
  return v;
}
__device__ __forceinline__ void store_line(uint8_t* dst, int64_t i, int64_t bytes, bool aligned8, uint2 v) {
  const int64_t at = 8 * i;
  if (aligned8 && at + 8 <= bytes) { *reinterpret_cast<uint2*>(dst + at) = v; return; }
  uint8_t t[8];
  memcpy(t, &v, 8);
  for (int j = 0; j < 8 && at + j < bytes; ++j) dst[at + j] = t[j];
}

// The elements of one 8-byte line, accumulated in E::A.
template <class E, class Op>
struct LineAcc {
  using S = typename E::S;
  using A = typename E::A;
  static constexpr int N = 8 / sizeof(S);
  A a[N];
  __device__ __forceinline__ void set(uint2 v) {
    S s[N];
    memcpy(s, &v, 8);
#pragma unroll
    for (int e = 0; e < N; ++e) a[e] = E::load(s[e]);
  }
  __device__ __forceinline__ void add(uint2 v) {
    S s[N];
    memcpy(s, &v, 8);
#pragma unroll
    for (int e = 0; e < N; ++e) a[e] = Op::apply(a[e], E::load(s[e]));
  }
  __device__ __forceinline__ uint2 get() const {
    S s[N];
#pragma unroll
    for (int e = 0; e < N; ++e) s[e] = E::store(a[e]);
    uint2 v;
    memcpy(&v, s, 8);
    return v;
  }
};

// Any thread: wait until `src`'s LL line carries this call's flags. False (after fail_call) when
// the call must stop: the producer gave up, the device stopped, or the budget ran out (a line
// whose first flag is this call but whose second is not came from another call site: mismatch).
__device__ bool ll_wait(const Params& p, Shared& sh, const uint4* line, uint32_t f0, uint32_t f1, int src,
                        int64_t elem_off, uint2* d) {
  const uint32_t* abort_word = reinterpret_cast<const uint32_t*>(p.site + p.off_abort) + src;
  for (uint32_t round = 1;; ++round) {
    const uint4 v = sync::ld_volatile_v4(line);
    if (v.y == f0 && v.w == f1) {
      *d = make_uint2(v.x, v.z);
      return true;
    }
    if ((round & 255u) == 0) {
      if (*reinterpret_cast<volatile int*>(&sh.fail)) return false;
      if (const uint32_t a = sync::ld_relaxed_sys(abort_word)) {
        fail_call(p, sh, kErrAborted, src, -1, elem_off, kAtOneShot, a);
        return false;
      }
      if (sync::ld_relaxed_sys(p.dev_claim) != 0u) {
        fail_call(p, sh, 0, src, -1, elem_off, kAtOneShot, 0);
        return false;
      }
      if (sync::globaltimer_ns() > sh.deadline) {
        fail_call(p, sh, v.y == f0 ? kErrMismatch : kErrTimeout, src, -1, elem_off, kAtOneShot, v.y);
        return false;
      }
    }
  }
}

// Mode::kLL. Thread t of block b owns lines b * kThreads + t + j * grid * kThreads. It first
// writes each of its lines into every peer's inbox (slot k & 1), then, per line, reads the
// peers' lines from its own inbox and reduces in rank order.
template <class E, class Op>
__global__ void __launch_bounds__(kThreads, 1) ll_kernel(const Params p) {
  __shared__ Shared sh;
  const int64_t bytes = p.os_elems * static_cast<int64_t>(sizeof(typename E::S));
  const int64_t lines = (bytes + 7) / 8;
  const uint8_t* in = static_cast<const uint8_t*>(p.in);
  const bool in8 = (reinterpret_cast<uintptr_t>(in) & 7u) == 0;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  // This thread's first line, loaded before the prologue's barrier: its memory round trip
  // overlaps the prologue's (the call counter, the device claim, the peers' bases).
  const uint2 first_line = first < lines ? load_line(in, first, bytes, in8) : make_uint2(0, 0);
  if (oneshot_begin(p, sh)) {
    const int n = p.nranks, me = p.rank;
    const uint32_t k = sh.k, f0 = k, f1 = k ^ p.os_site;
    const int par = static_cast<int>(k & 1u);
    uint8_t* out = static_cast<uint8_t*>(p.out);
    const bool out8 = (reinterpret_cast<uintptr_t>(out) & 7u) == 0;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
    for (int64_t i = first; i < lines; i += stride) {
      const uint2 d = i == first ? first_line : load_line(in, i, bytes, in8);
      for (int dst = 0; dst < n; ++dst) {
        if (dst == me) continue;
        uint4* line = reinterpret_cast<uint4*>(stg_data(p, sh.stg_peer[dst], par, inbox_slot(me, dst))) + i;
        sync::st_volatile_v4(line, d.x, f0, d.y, f1);
      }
    }
    bool ok = true;
    for (int64_t i = first; ok && i < lines; i += stride) {
      const uint2 mine = i == first ? first_line : load_line(in, i, bytes, in8);
      LineAcc<E, Op> acc;
      for (int src = 0; ok && src < n; ++src) {
        uint2 d = mine;
        if (src != me) {
          const uint4* line = reinterpret_cast<const uint4*>(stg_data(p, p.stg, par, inbox_slot(src, me))) + i;
          ok = ll_wait(p, sh, line, f0, f1, src, 8 * i / static_cast<int64_t>(sizeof(typename E::S)), &d);
        }
        if (src == 0) acc.set(d);
        else acc.add(d);
      }
      if (ok) store_line(out, i, bytes, out8, acc.get());
    }
    fail_if_a_peer_gave_up(p, sh);
  }
  oneshot_end(p, sh);
}

// Thread 0: wait until `flag` holds this call's tag (call number | site << 32), with the budget.
__device__ bool wait_tag(const Params& p, Shared& sh, const uint64_t* flag, uint64_t tag, int src, int64_t elem_off) {
  const uint32_t* abort_word = reinterpret_cast<const uint32_t*>(p.site + p.off_abort) + src;
  const uint32_t k = static_cast<uint32_t>(tag);
  for (uint32_t round = 1;; ++round) {
    const uint64_t v = sync::ld_acquire_sys_u64(flag);
    const uint32_t seen = static_cast<uint32_t>(v);
    if (sync::seq_reached(seen, k)) {
      if (v == tag) {
        if (const uint32_t a = sync::ld_relaxed_sys(abort_word)) {  // it gave up after publishing
          fail_call(p, sh, kErrAborted, src, -1, elem_off, kAtOneShot, a);
          return false;
        }
        sh.deadline = sync::globaltimer_ns() + p.timeout_ns;
        return true;
      }
      fail_call(p, sh, seen != k ? kErrAhead : kErrMismatch, src, -1, elem_off, kAtOneShot, seen);
      return false;
    }
    if ((round & 63u) == 0) {
      if (const uint32_t a = sync::ld_relaxed_sys(abort_word)) {
        fail_call(p, sh, kErrAborted, src, -1, elem_off, kAtOneShot, a);
        return false;
      }
      if (sync::ld_relaxed_sys(p.dev_claim) != 0u) {
        fail_call(p, sh, 0, src, -1, elem_off, kAtOneShot, 0);
        return false;
      }
      if (sync::globaltimer_ns() > sh.deadline) {
        fail_call(p, sh, kErrTimeout, src, -1, elem_off, kAtOneShot, seen);
        return false;
      }
      if (round > 4096u) __nanosleep(256);
    }
  }
}

// Mode::kOneShot. Block b owns chunks b, b + grid, ...: it copies chunk c into every peer's inbox
// and release-flags it there, and reduces chunk c once every peer's flag for c is in, sending
// chunk c + grid before it waits for c.
template <class E, class Op>
__global__ void __launch_bounds__(kThreads, 1) oneshot_kernel(const Params p) {
  using S = typename E::S;
  __shared__ Shared sh;
  if (oneshot_begin(p, sh)) {
    const int n = p.nranks, me = p.rank, tid = threadIdx.x;
    const uint32_t k = sh.k;
    const uint64_t tag = (static_cast<uint64_t>(p.os_site) << 32) | k;
    const int par = static_cast<int>(k & 1u);
    const S* in = static_cast<const S*>(p.in);
    S* out = static_cast<S*>(p.out);
    const int64_t C = p.os_chunk, total = p.os_elems;
    const int64_t nch = (total + C - 1) / C;
    auto send = [&](int64_t c) {
      const int64_t lo = c * C, len = min(C, total - lo);
      if (tid == 0) {
        int nd = 0;
        for (int dst = 0; dst < n; ++dst)
          if (dst != me)
            sh.dst[nd++] = stg_data(p, sh.stg_peer[dst], par, inbox_slot(me, dst)) + lo * sizeof(S);
      }
      __syncthreads();
      combine_range<E, Op>(nullptr, in + lo, nullptr, 0, reinterpret_cast<S* const*>(sh.dst), n - 1, len);
      __syncthreads();  // every thread's stores before the release
      if (tid == 0)
        for (int dst = 0; dst < n; ++dst)
          if (dst != me) sync::st_release_sys_u64(stg_flags(p, sh.stg_peer[dst], par, inbox_slot(me, dst)) + c, tag);
    };
    auto reduce = [&](int64_t c) {
      const int64_t lo = c * C, len = min(C, total - lo);
      if (tid == 0) {
        bool ok = true;
        for (int src = 0; ok && src < n; ++src)
          if (src != me) ok = wait_tag(p, sh, stg_flags(p, p.stg, par, inbox_slot(src, me)) + c, tag, src, lo);
        for (int src = 0; src < n; ++src)  // in rank order: every rank rounds the same way
          sh.src[src] = src == me ? static_cast<const void*>(in + lo)
                                  : stg_data(p, p.stg, par, inbox_slot(src, me)) + lo * sizeof(S);
      }
      __syncthreads();
      if (sh.fail) return false;
      combine_range<E, Op>(out + lo, static_cast<const S*>(sh.src[0]), reinterpret_cast<const S* const*>(sh.src + 1),
                           n - 1, nullptr, 0, len);
      __syncthreads();  // sh.src / sh.dst are rewritten by the next step
      return true;
    };
    int64_t c = blockIdx.x;
    if (c < nch) send(c);
    for (; c < nch; c += gridDim.x) {
      if (c + gridDim.x < nch) send(c + gridDim.x);
      if (!reduce(c)) break;
    }
  }
  oneshot_end(p, sh);
}

// One rank (a mesh axis of one device): every collective is the identity, out = in, and nobody is
// waited for or told anything (no counter, no flags, no device claim: a failed device's one-rank
// call still returns its operand). A small kernel of its own: launched as the tree kernel, the
// same copy cost half as much again as XLA's copy-sized fusion (the collective kernels' 512-thread
// blocks, 300-byte parameter block and size; benchmarks/NOTES.md, change 8).
// Launched with as many threads as a small copy has 16-byte words (at least a warp, at most
// kCopyThreads: 64 for 1 KiB, the shape of XLA's fusion), so no thread only checks its bound.
constexpr int kCopyThreads = 256;
constexpr int64_t kCopyBytesPerBlock = int64_t{kCopyThreads} * 16 * 8;
__global__ void __launch_bounds__(kCopyThreads) one_rank_kernel(const uint8_t* in, uint8_t* out, int64_t bytes) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t nvec = ((reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) & 15u) == 0 ? bytes / 16 : 0;
  // Not unrolled: a small copy is one iteration per thread, and the unrolled loop's trip count
  // costs an integer division first (seen in the PTX).
#pragma unroll 1
  for (int64_t i = first; i < nvec; i += stride) reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(in)[i];
#pragma unroll 1
  for (int64_t i = nvec * 16 + first; i < bytes; i += stride) out[i] = in[i];
}

}  // namespace
}  // namespace jax_blink::cuda

// The LL reduce-scatter and all-gather, a primitive of its own (it uses the LL all-reduce's
// prologue, inbox and waits above).
#include "cuda/ll_blocks.cuh"
// The two-shot kernel, a primitive of its own (it uses the flags, pointer exchange and data movers
// above), before the kernel table below.
#include "cuda/two_shot.cuh"
// The copy-engine all-reduce's reduction, a primitive of its own (it uses combine_range above).
#include "cuda/reduce_terms.cuh"

namespace jax_blink::cuda {
namespace {

using KernelFn = void (*)(const Params);

template <class E, class Op>
constexpr KernelFn kernel_for_mode(Mode m) {  // kTree and kHybrid: the tree kernel
  return m == Mode::kLL        ? &ll_kernel<E, Op>
         : m == Mode::kLLBlocks ? &ll_blocks_kernel<E, Op>
         : m == Mode::kOneShot ? &oneshot_kernel<E, Op>
         : m == Mode::kTwoShot ? &two_shot_kernel<E, Op>
                               : &collective_kernel<E, Op>;
}

template <class E>
constexpr KernelFn kernel_for_op(int op, Mode m) {
  return op == 0 ? kernel_for_mode<E, OpSum>(m) : op == 1 ? kernel_for_mode<E, OpMax>(m) : kernel_for_mode<E, OpMin>(m);
}

KernelFn KernelFor(DType d, int op, Mode m) {
  switch (d) {
    case DType::kF32: return kernel_for_op<EF32>(op, m);
    case DType::kF64: return kernel_for_op<EF64>(op, m);
    case DType::kBF16: return kernel_for_op<EBF16>(op, m);
    case DType::kF16: return kernel_for_op<EF16>(op, m);
    case DType::kS32: return kernel_for_op<ES32>(op, m);
    case DType::kS64: return kernel_for_op<ES64>(op, m);
  }
  return nullptr;
}

constexpr Mode kModes[] = {Mode::kTree, Mode::kLL, Mode::kOneShot, Mode::kTwoShot, Mode::kLLBlocks};  // the kernels (kHybrid runs kTree's)

}  // namespace
}  // namespace jax_blink::cuda
