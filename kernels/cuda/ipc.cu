// CUDA back end of "jax_blink_collective_ipc": see cuda/ipc.h.
//
// Region of one rank (cudaMalloc on its GPU, exported once with cudaIpcGetMemHandle):
//   [0, 256)                control: the push kernel's block counter, the consume kernels' failure claim
//   [off_flags, +4 nranks)  flag[p]: the last call number rank p signalled into this region
//   [off_inbox, ...)        inbox[parity][slot]: the pieces pushed to this rank in calls of that parity
// Call g (numbered per rank, every rank runs the same calls): parity g & 1.
// Push kernel: copies this rank's pieces into the inboxes of the OTHER ranks that need them (parity
// g & 1), then its last block (block counter, __threadfence_system) stores g into flag[rank] of
// EVERY rank's region with st.release.sys, whether or not that rank got data.
// Consume kernel: thread 0 of each block waits (ld.acquire.sys, deadline on %globaltimer) until
// flag[p] >= g for EVERY p, then the block reduces or copies its inbox (parity g & 1) into the result.
//   all_reduce:     rank r pushes x into slot r of every other inbox; every rank reduces slots
//                   0..n-1, its own term from x.
//   all_gather:     rank r pushes piece r of x into slot r of every other inbox; every rank copies
//                   slot p to piece p of its result, its own piece from x.
//   reduce_scatter: rank r pushes piece j of x into slot r of rank j's inbox (j != r); rank j
//                   reduces slots 0..n-1 into piece j of its result, its own term from x.
//   broadcast:      the root pushes x into slot 0 of every other rank's inbox; they copy it out,
//                   the root copies its own x.
//   reduce:         every other rank pushes x into slot r of the root's inbox; the root reduces
//                   slots 0..n-1, its own term from x, the others copy their own x
//                   (collectives.reduce keeps it anyway).
// No rank pushes to itself (its own term is read from its operand, one local copy less); slot r of
// rank r's inbox stays unused, so that every receiving rank has the same layout and a pusher finds
// a peer's slot from its own.
// Slots hold one piece (all_gather, reduce_scatter: operand / n bytes) or the whole operand; a
// rank that receives nothing (broadcast's root, reduce's non-roots) allocates no inbox.
// Reductions run in rank order, so ranks that compute the same element get the same bits.
//
// Why two parities suffice, also where data goes to only some ranks: every rank signals every
// rank in every call and waits for every rank's signal, so the flags form a full barrier per call
// whatever the data pattern. Rank q writes parity (g & 1) of rank p's inbox in call g only after
// q's call g - 1 consume (stream order) saw p's flag reach g - 1; p stored that flag at the end of
// its call g - 1 push, which follows (stream order) p's call g - 2 consume, the last reader of
// parity (g & 1) before call g. So the inbox q writes is free. Flags only grow and a wait asks
// for >= g, so a peer one call ahead does not confuse it (it cannot be two ahead: its call g + 1
// consume needs this rank's flag g + 1). Drop either half (a rank that pushes no data skipping
// its signal, or a rank that needs no data skipping its wait) and a broadcast's root, which waits
// for nobody's data, could overwrite an inbox that its reader has not copied out yet.
// A wait past its budget records who it waited for in pinned host memory; the next call of that
// collective on this GPU, or jax_blink.check(), returns the error (a kernel cannot raise) naming
// the rank and its process.

#include "cuda/ipc.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <set>
#include <tuple>
#include <vector>

#include "cuda/device_sync.cuh"
#include "cuda/gpu_binding.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_blink::cuda_ipc {
namespace {

namespace sync = jax_blink::cuda::sync;

constexpr size_t kAlign = 256;
constexpr int kThreads = 512;

// Words of a region's control area [0, kAlign): the push kernel's block counter, and the
// failure claim of its consume kernels.
constexpr int kCounterWord = 0, kClaimWord = 1;

size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

struct ErrRec {  // pinned, mapped host memory: written by a consume kernel on a timeout
  volatile int32_t failed;  // stored last: the fields below are complete once the host sees it
  volatile int32_t waited_for;
  volatile uint32_t call;
  volatile uint32_t observed;
};

struct Comm {
  int64_t comm_id = 0;
  int32_t group = 0, rank = 0, nranks = 0;
  Collective kind = Collective::kAllReduce;
  int32_t root = 0;
  std::vector<int32_t> processes;  // every rank's process index (messages), may be empty
  int device = 0;
  int64_t bytes = 0;  // the operand's (and the result's) size
  int64_t piece = 0;  // what one rank pushes to one peer
  // The kernels' most blocks: one per SM, as the one-process executor uses (an SM issues a
  // bounded number of remote stores at once, so the link needs many SMs: docs/DESIGN.md, "Facts
  // and measured ceilings"), or JAX_BLINK_IPC_BLOCKS.
  int max_blocks = 1;
  size_t slot = 0, off_flags = 0, off_inbox = 0, size = 0;
  char* mine = nullptr;
  std::vector<char*> peers;      // every rank's region, as this process addresses it
  std::vector<char> opened_ipc;  // which peers[] came from cudaIpcOpenMemHandle
  std::vector<int64_t> pids;     // every rank's process id (from its payload; 0 unknown)
  std::vector<uint64_t> addrs;   // every rank's region address in its own process (from its payload)
  std::string stale;             // why this collective can no longer run (a peer's region replaced), or empty
  int opened = 0;
  char** d_peers = nullptr;      // peers[] on the device, once every peer is open
  uint32_t seq = 0;
  ErrRec* err = nullptr;
  ErrRec* d_err = nullptr;
};

std::mutex g_mu;
std::map<std::tuple<int64_t, int32_t, int32_t>, std::unique_ptr<Comm>> g_comms;  // (comm, group, rank)
std::map<std::pair<int64_t, int>, Comm*> g_by_device;                           // (comm, device)
// Regions this process exported and freed, as (device, address): a peer that still maps one (its
// close refused, or never made) cannot map a new region at that address ("already mapped").
std::set<std::pair<int, uintptr_t>> g_released;

// Slots of a receiving rank's inbox per parity (the same in every receiving rank, so that a
// pusher computes a peer's slot address from its own layout).
int InboxSlots(Collective k, int nranks) { return k == Collective::kBroadcast ? 1 : nranks; }

// Whether rank `r` receives pushed data at all.
bool Receives(Collective k, int r, int root) {
  if (k == Collective::kBroadcast) return r != root;
  if (k == Collective::kReduce) return r == root;
  return true;
}

std::string CudaError(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}

struct DeviceGuard {
  int saved = 0;
  explicit DeviceGuard(int d) {
    cudaGetDevice(&saved);
    cudaSetDevice(d);
  }
  ~DeviceGuard() { cudaSetDevice(saved); }
};

std::string RankName(const Comm& c, int r) {
  std::string s = "rank " + std::to_string(r);
  if (static_cast<size_t>(r) < c.processes.size() && c.processes[r] >= 0)
    s += " (process " + std::to_string(c.processes[r]) + ")";
  return s;
}

// Whether the process `pid` of this host is gone (IPC peers share the host).
bool Exited(int64_t pid) { return pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH; }

// The sticky error of a communicator whose wait ran out of time ("" if none).
std::string TimeoutMessage(const Comm& c) {
  if (c.err == nullptr || c.err->failed == 0) return {};
  const int w = c.err->waited_for;
  const int64_t pid = w >= 0 && static_cast<size_t>(w) < c.pids.size() ? c.pids[w] : 0;
  const std::string why = Exited(pid) ? "its process (pid " + std::to_string(pid) + ") has exited"
                                      : "a process skipped this collective, died or is stuck";
  return "jax_blink (CUDA IPC, device " + std::to_string(c.device) + ", collective " + std::to_string(c.comm_id) +
         "): " + RankName(c, c.rank) + " waited past its budget for " + RankName(c, w) + " in call #" +
         std::to_string(c.err->call) + " (its last call here: #" + std::to_string(c.err->observed) + "): " + why +
         ". This collective fails from now on.";
}

// ---------------------------------------------------------------------------------------------
// Kernels.

template <class U>
__device__ __forceinline__ void GridCopyUnits(char* dst, const char* src, int64_t bytes) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n = bytes / static_cast<int64_t>(sizeof(U));
  U* d = reinterpret_cast<U*>(dst);
  const U* s = reinterpret_cast<const U*>(src);
  for (int64_t i = tid; i < n; i += stride) d[i] = __ldcg(s + i);
  for (int64_t i = n * static_cast<int64_t>(sizeof(U)) + tid; i < bytes; i += stride) dst[i] = __ldcg(src + i);
}

// Copies `bytes` bytes from src to dst by the grid's threads in a grid-stride loop, in the widest
// unit (16, 4, 2 or 1 bytes) both addresses are aligned to: the pieces of a 3-process
// reduce-scatter start off 16 bytes, and byte copies take 16 times the instructions.
__device__ __forceinline__ void GridCopy(char* dst, const char* src, int64_t bytes) {
  const uintptr_t both = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  if ((both & 15u) == 0) GridCopyUnits<uint4>(dst, src, bytes);
  else if ((both & 3u) == 0) GridCopyUnits<unsigned int>(dst, src, bytes);
  else if ((both & 1u) == 0) GridCopyUnits<unsigned short>(dst, src, bytes);
  else GridCopyUnits<char>(dst, src, bytes);
}

// Pushes x + x_off + p * x_stride (`bytes` bytes) into peers[p] + dst_off for every p in
// [lo, hi) but `skip`, then its last block signals call `seq` into flag[rank] of EVERY rank's
// region (see the proof above: ranks that got no data are signalled too).
__global__ void PushKernel(const char* x, int64_t x_off, int64_t x_stride, int64_t bytes,
                           char* const* peers, int nranks, int lo, int hi, int skip, int rank,
                           size_t dst_off, size_t off_flags, uint32_t seq, unsigned* counter) {
  for (int p = lo; p < hi; ++p)
    if (p != skip) GridCopy(peers[p] + dst_off, x + x_off + p * x_stride, bytes);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    if (atomicAdd(counter, 1u) == gridDim.x - 1) {  // the last block: every block's data is out
      *counter = 0;
      __threadfence_system();
      for (int p = 0; p < nranks; ++p)
        sync::st_release_sys(reinterpret_cast<uint32_t*>(peers[p] + off_flags) + rank, seq);
    }
  }
}

// Thread 0 waits until every rank's flag in this region reached `seq` (or the budget ends, or
// another block gave up); the block learns the outcome. The first block to give up claims the
// region's failure word (device memory, sticky: a real atomic, unlike one on mapped host memory)
// and records whom it waited for.
__device__ bool BlockWaitAll(const char* mine, int nranks, size_t off_flags, uint32_t seq,
                             uint64_t timeout_ns, ErrRec* err) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    const uint32_t* flags = reinterpret_cast<const uint32_t*>(mine + off_flags);
    unsigned* claim = const_cast<unsigned*>(reinterpret_cast<const unsigned*>(mine)) + kClaimWord;
    const uint64_t deadline = sync::globaltimer_ns() + timeout_ns;
    for (int p = 0; p < nranks && ok; ++p) {
      uint32_t v = sync::ld_acquire_sys(flags + p);
      for (uint32_t round = 1; !sync::seq_reached(v, seq); ++round) {
        if ((round & 63u) == 0) {
          if (*static_cast<volatile unsigned*>(claim) != 0u || sync::globaltimer_ns() > deadline) {
            if (atomicCAS(claim, 0u, 1u) == 0u) {
              err->waited_for = p;
              err->call = seq;
              err->observed = v;
              __threadfence_system();
              err->failed = 1;
              __threadfence_system();
            }
            ok = 0;
            break;
          }
          __nanosleep(256);
        }
        v = sync::ld_acquire_sys(flags + p);
      }
    }
  }
  __syncthreads();
  return ok != 0;
}

template <class T>
struct Acc {
  using type = T;
  __device__ static T Load(T v) { return v; }
  __device__ static T Store(T v) { return v; }
};
template <>
struct Acc<__nv_bfloat16> {
  using type = float;
  __device__ static float Load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 Store(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Acc<__half> {
  using type = float;
  __device__ static float Load(__half v) { return __half2float(v); }
  __device__ static __half Store(float v) { return __float2half_rn(v); }
};

template <int OP, class A>
__device__ __forceinline__ A Combine(A a, A b) {
  if constexpr (OP == 0) return a + b;
  else if constexpr (OP == 1) return (a >= b || a != a) ? a : b;  // NaN propagates, as numpy
  else return (a <= b || a != a) ? a : b;
}

// Waits for every rank, then out[i] = slot 0 [i] op slot 1 [i] op ... (rank order), i < n, where
// slot `own_slot` is this rank's own term, read from `own` (its operand: never pushed to itself).
// out may be own (in place): element i is read before it is written, by the same thread.
template <class T, int OP>
__global__ void WaitReduceKernel(const char* mine, const T* own, int own_slot, T* out, int64_t n, int nranks,
                                 size_t src_off, size_t slot, size_t off_flags, uint32_t seq,
                                 uint64_t timeout_ns, ErrRec* err) {
  if (!BlockWaitAll(mine, nranks, off_flags, seq, timeout_ns, err)) return;
  using A = Acc<T>;
  const T* base = reinterpret_cast<const T*>(mine + src_off);
  const size_t slot_elems = slot / sizeof(T);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    auto acc = A::Load(__ldcg((own_slot == 0 ? own : base) + i));
    for (int p = 1; p < nranks; ++p)
      acc = Combine<OP>(acc, A::Load(__ldcg((p == own_slot ? own : base + p * slot_elems) + i)));
    out[i] = A::Store(acc);
  }
}

// Waits for every rank, then copies `count` pieces of `bytes` bytes: src + k * src_stride to
// dst + k * dst_stride, but piece `own_k` from `own` (this rank's own piece, never pushed to
// itself), or not at all where `own` is already that piece of dst (in place).
__global__ void WaitCopyKernel(const char* mine, const char* src, int64_t src_stride, char* dst,
                               int64_t dst_stride, int count, int own_k, const char* own, int64_t bytes,
                               int nranks, size_t off_flags, uint32_t seq, uint64_t timeout_ns,
                               ErrRec* err) {
  if (!BlockWaitAll(mine, nranks, off_flags, seq, timeout_ns, err)) return;
  for (int k = 0; k < count; ++k) {
    char* d = dst + k * dst_stride;
    if (k != own_k) GridCopy(d, src + k * src_stride, bytes);
    else if (own != d) GridCopy(d, own, bytes);
  }
}

struct ReduceArgs {
  const char* mine;
  const void* own;  // this rank's own term (its operand, or its piece of it)
  int own_slot;     // the slot it stands for (-1: none)
  void* out;
  int64_t n;
  int nranks;
  size_t src_off, slot, off_flags;
  uint32_t seq;
  uint64_t timeout_ns;
  ErrRec* err;
};

template <class T>
cudaError_t LaunchReduce(int op, int blocks, cudaStream_t s, const ReduceArgs& a) {
  T* o = static_cast<T*>(a.out);
  const T* w = static_cast<const T*>(a.own);
  if (op == 0) WaitReduceKernel<T, 0><<<blocks, kThreads, 0, s>>>(a.mine, w, a.own_slot, o, a.n, a.nranks, a.src_off, a.slot, a.off_flags, a.seq, a.timeout_ns, a.err);
  else if (op == 1) WaitReduceKernel<T, 1><<<blocks, kThreads, 0, s>>>(a.mine, w, a.own_slot, o, a.n, a.nranks, a.src_off, a.slot, a.off_flags, a.seq, a.timeout_ns, a.err);
  else WaitReduceKernel<T, 2><<<blocks, kThreads, 0, s>>>(a.mine, w, a.own_slot, o, a.n, a.nranks, a.src_off, a.slot, a.off_flags, a.seq, a.timeout_ns, a.err);
  return cudaGetLastError();
}

bool Supported(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: case ffi::DataType::F64: case ffi::DataType::S32:
    case ffi::DataType::S64: case ffi::DataType::BF16: case ffi::DataType::F16: return true;
    default: return false;
  }
}

// For a type that Supported() accepted.
cudaError_t LaunchReduceTyped(ffi::DataType t, int op, int blocks, cudaStream_t s, const ReduceArgs& a) {
  switch (t) {
    case ffi::DataType::F32: return LaunchReduce<float>(op, blocks, s, a);
    case ffi::DataType::F64: return LaunchReduce<double>(op, blocks, s, a);
    case ffi::DataType::S32: return LaunchReduce<int32_t>(op, blocks, s, a);
    case ffi::DataType::S64: return LaunchReduce<long long>(op, blocks, s, a);
    case ffi::DataType::BF16: return LaunchReduce<__nv_bfloat16>(op, blocks, s, a);
    default: return LaunchReduce<__half>(op, blocks, s, a);
  }
}

// A grid of one thread per unit, at most `cap` blocks (Comm::max_blocks).
int BlocksFor(int64_t units, int cap) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(cap, (units + kThreads - 1) / kThreads)));
}

ffi::Error Fail(ffi::ErrorCode code, std::string msg) { return ffi::Error(code, std::move(msg)); }

ffi::Error Execute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> /*rank*/,
                   ffi::Buffer<ffi::S32> /*group*/, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Span<const int32_t> /*program*/, int32_t op, int64_t comm_id, int64_t timeout_ms,
                   float /*host_share*/, ffi::Span<const int32_t> /*rank_process*/,
                   ffi::Span<const int32_t> /*rank_device*/, int64_t /*setup_timeout_ms*/) {
  Comm* c = nullptr;
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_by_device.find({comm_id, device});
    if (it != g_by_device.end()) c = it->second;
  }
  const std::string where = "jax_blink (CUDA IPC, device " + std::to_string(device) + ", collective " +
                            std::to_string(comm_id) + "): ";
  // A failed collective first: ReleaseFailed() leaves it without its peers' regions, and its
  // message says why.
  const std::string timed_out = c == nullptr ? std::string() : TimeoutMessage(*c);
  if (!timed_out.empty()) return Fail(ffi::ErrorCode::kDeadlineExceeded, timed_out);
  if (c != nullptr && !c->stale.empty()) return Fail(ffi::ErrorCode::kFailedPrecondition, where + c->stale);
  if (c == nullptr || c->d_peers == nullptr)
    return Fail(ffi::ErrorCode::kFailedPrecondition,
                where + "not set up in this process (the lowering's set-up did not run for this device)");
  if (static_cast<int64_t>(x.size_bytes()) != c->bytes || out->size_bytes() != x.size_bytes())
    return Fail(ffi::ErrorCode::kInvalidArgument, where + "operand size differs from the set-up's");
  if (op < 0 || op > 2) return Fail(ffi::ErrorCode::kInvalidArgument, where + "op must be 0, 1 or 2");
  // Refused before anything is launched: a call that pushes must also consume (the call count).
  const int64_t itemsize = static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  if (!Supported(x.element_type()) || c->piece % itemsize != 0)
    return Fail(ffi::ErrorCode::kInvalidArgument, where + "unsupported dtype (float32, float64, bfloat16, float16, "
                                                          "int32, int64 are), or a piece of a fraction of an element");

  const Collective k = c->kind;
  const int n = c->nranks, r = c->rank, root = c->root;
  const uint32_t seq = ++c->seq;
  const size_t par = seq & 1u;
  const size_t recv_slots = static_cast<size_t>(InboxSlots(k, n));
  const size_t slot_index = k == Collective::kBroadcast ? 0 : static_cast<size_t>(r);
  const size_t dst_off = c->off_inbox + (par * recv_slots + slot_index) * c->slot;  // in a receiver's region
  const size_t src_off = c->off_inbox + par * recv_slots * c->slot;                // in mine
  const char* xs = static_cast<const char*>(x.untyped_data());
  char* os = static_cast<char*>(out->untyped_data());

  // What this rank pushes: x + x_off + p * x_stride (piece bytes) to every p in [lo, hi) but skip.
  int64_t x_off = 0, x_stride = 0, push_bytes = c->piece;
  // Never to itself: its consume kernel reads its own term from x (one local copy less).
  int lo = 0, hi = n, skip = r;
  switch (k) {
    case Collective::kAllReduce: break;
    case Collective::kAllGather: x_off = r * c->piece; break;
    case Collective::kReduceScatter: x_stride = c->piece; break;
    case Collective::kBroadcast:
      if (r != root) push_bytes = 0, hi = 0;  // signals only
      break;
    case Collective::kReduce: lo = root, hi = root + 1; break;
  }
  PushKernel<<<BlocksFor(push_bytes / 16 + 1, c->max_blocks), kThreads, 0, stream>>>(
      xs, x_off, x_stride, push_bytes, c->d_peers, n, lo, hi, skip, r, dst_off, c->off_flags, seq,
      reinterpret_cast<unsigned*>(c->mine) + kCounterWord);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Fail(ffi::ErrorCode::kInternal, where + CudaError("launch (push)", e));

  const uint64_t tns = static_cast<uint64_t>(timeout_ms > 0 ? timeout_ms : 10000) * 1000000ull;
  const bool reduces = k == Collective::kAllReduce || k == Collective::kReduceScatter ||
                       (k == Collective::kReduce && r == root);
  if (reduces) {
    // reduce_scatter: this rank's piece only; the others: the whole operand.
    const int64_t out_off = k == Collective::kReduceScatter ? r * c->piece : 0;
    const int64_t elems = c->piece / itemsize;
    // Its own term: x, or (reduce_scatter) its own piece of x, standing for slot r.
    const ReduceArgs a{c->mine, xs + out_off, r, os + out_off, elems, n, src_off, c->slot, c->off_flags,
                       seq, tns, c->d_err};
    e = LaunchReduceTyped(x.element_type(), op, BlocksFor(elems, c->max_blocks), stream, a);
  } else {
    // Copies: all_gather every slot to its piece; a broadcast's non-root its one slot; a
    // broadcast's root and a reduce's non-roots their own x (nothing where the result is x).
    const char* src = c->mine + src_off;
    int64_t src_stride = static_cast<int64_t>(c->slot), dst_stride = c->piece;
    int count = 1, own_k = -1;
    const char* own = nullptr;
    if (k == Collective::kAllGather) count = n, own_k = r, own = xs + r * c->piece;  // its own piece from x
    if (!Receives(k, r, root)) own_k = 0, own = xs;  // its own x (nothing to copy in place)
    WaitCopyKernel<<<BlocksFor(c->piece / 16 + 1, c->max_blocks), kThreads, 0, stream>>>(
        c->mine, src, src_stride, os, dst_stride, count, own_k, own, c->piece, n, c->off_flags, seq, tns,
        c->d_err);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) return Fail(ffi::ErrorCode::kInternal, where + CudaError("launch (consume)", e));
  return ffi::Error::Success();
}

// Closes c's mapping of rank q's region, if it has one. A close that CUDA refuses (the peer's process
// gone, or its memory freed first) is cleared: the mapping counts as closed either way.
void ClosePeerMapping(Comm& c, int q) {
  if (!c.opened_ipc[q]) return;
  if (cudaIpcCloseMemHandle(c.peers[q]) != cudaSuccess) cudaGetLastError();
  c.opened_ipc[q] = 0;
}

// cudaMalloc of an IPC region at an address this process has not exported before: one it exported
// and freed may still be mapped by a peer whose close CUDA refused (that peer could never map the
// new region). The refused addresses are held while allocating, then freed.
cudaError_t AllocateFreshRegion(int device, size_t size, char** out) {
  std::vector<char*> held;
  cudaError_t e = cudaSuccess;
  char* p = nullptr;
  for (int attempt = 0; attempt < 8; ++attempt) {
    e = cudaMalloc(&p, size);
    if (e != cudaSuccess || !g_released.count({device, reinterpret_cast<uintptr_t>(p)})) break;
    held.push_back(p);
  }
  if (e == cudaSuccess && !held.empty() && held.back() == p) held.pop_back();  // 8 refused: the last one serves
  for (char* h : held) cudaFree(h);
  if (e == cudaSuccess) *out = p;
  return e;
}

}  // namespace

std::string Create(int64_t comm_id, int32_t group, int32_t rank, int32_t nranks, int64_t bytes, int device,
                   Collective kind, int32_t root, const std::vector<int32_t>& processes,
                   std::vector<uint8_t>* payload) {
  if (nranks < 2 || rank < 0 || rank >= nranks || bytes <= 0) return "bad rank, rank count or size";
  if (static_cast<int>(kind) < 0 || static_cast<int>(kind) >= kNumCollectives) return "unknown collective";
  if (root < 0 || root >= nranks) return "root out of range";
  long max_blocks = 0;  // 0: one per SM
  if (const char* v = std::getenv("JAX_BLINK_IPC_BLOCKS"); v != nullptr) {
    char* end = nullptr;
    max_blocks = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || max_blocks < 1 || max_blocks > 1024)
      return "JAX_BLINK_IPC_BLOCKS='" + std::string(v) + "' is not understood: the IPC kernels' most blocks, "
             "an integer from 1 to 1024 (unset: one per SM)";
  }
  if (max_blocks == 0) {
    int sms = 0;
    const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) return CudaError("the device's SM count", e);
    max_blocks = std::max(1, sms);
  }
  const bool pieces = kind == Collective::kAllGather || kind == Collective::kReduceScatter;
  if (pieces && bytes % nranks != 0)
    return "operand of " + std::to_string(bytes) + " bytes does not split into " + std::to_string(nranks) + " pieces";
  std::lock_guard<std::mutex> g(g_mu);
  auto key = std::make_tuple(comm_id, group, rank);
  if (g_comms.count(key)) return "rank " + std::to_string(rank) + " of this collective is already registered";
  auto c = std::make_unique<Comm>();
  c->comm_id = comm_id;
  c->group = group;
  c->rank = rank;
  c->nranks = nranks;
  c->kind = kind;
  c->root = root;
  c->processes = processes;
  c->device = device;
  c->max_blocks = static_cast<int>(max_blocks);
  c->bytes = bytes;
  c->piece = pieces ? bytes / nranks : bytes;
  c->slot = AlignUp(static_cast<size_t>(c->piece));
  c->off_flags = kAlign;
  c->off_inbox = AlignUp(c->off_flags + 4 * static_cast<size_t>(nranks));
  const size_t slots = Receives(kind, rank, root) ? static_cast<size_t>(InboxSlots(kind, nranks)) : 0;
  c->size = c->off_inbox + 2 * slots * c->slot;
  DeviceGuard dg(device);
  cudaError_t e = AllocateFreshRegion(device, c->size, &c->mine);
  if (e != cudaSuccess) return CudaError("cudaMalloc of the IPC region", e);
  e = cudaMemset(c->mine, 0, c->size);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  cudaIpcMemHandle_t h;
  if (e == cudaSuccess) e = cudaIpcGetMemHandle(&h, c->mine);
  if (e != cudaSuccess) {
    cudaFree(c->mine);
    return CudaError("cudaIpcGetMemHandle (CUDA IPC refused)", e);
  }
  e = cudaHostAlloc(reinterpret_cast<void**>(&c->err), sizeof(ErrRec), cudaHostAllocMapped);
  if (e == cudaSuccess) e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&c->d_err), c->err, 0);
  if (e != cudaSuccess) {
    cudaFree(c->mine);
    return CudaError("pinned error record", e);
  }
  std::memset(const_cast<ErrRec*>(c->err), 0, sizeof(ErrRec));
  c->peers.assign(nranks, nullptr);
  c->opened_ipc.assign(nranks, 0);
  c->pids.assign(nranks, 0);
  c->addrs.assign(nranks, 0);
  c->pids[rank] = getpid();
  c->peers[rank] = c->mine;
  payload->resize(sizeof(h) + 16);
  const uint64_t pid = static_cast<uint64_t>(getpid()), addr = reinterpret_cast<uintptr_t>(c->mine);
  std::memcpy(payload->data(), &h, sizeof(h));
  std::memcpy(payload->data() + sizeof(h), &pid, 8);
  std::memcpy(payload->data() + sizeof(h) + 8, &addr, 8);
  g_by_device[{comm_id, device}] = c.get();
  g_comms[key] = std::move(c);
  return {};
}

// Closes this process's mappings of the region that process `pid` had at `addr` (in that process),
// held by collectives other than `keep`: CUDA refuses to map a region again while an older mapping
// of the same address in that process is open, which happens once that process has freed its
// collective memory (a failure there) and allocated it anew. Such a collective can no longer run:
// it is marked stale, with the reason its calls give. Returns how many mappings were closed.
int CloseStaleMappings(const Comm* keep, int device, int64_t pid, uint64_t addr) {
  int closed = 0;
  for (auto& [key, o] : g_comms) {
    if (o.get() == keep || o->device != device) continue;
    for (int q = 0; q < o->nranks; ++q) {
      if (!o->opened_ipc[q] || o->pids[q] != pid || o->addrs[q] != addr) continue;
      if (closed == 0 && cudaDeviceSynchronize() != cudaSuccess) cudaGetLastError();  // its kernels have ended
      ClosePeerMapping(*o, q);
      o->stale = RankName(*o, q) + "'s process (pid " + std::to_string(pid) +
                 ") freed its collective memory and made new memory at the same address, so its old region is "
                 "closed here; this collective cannot run again: call jax_blink.reset() and run the program "
                 "again (a new collective is set up)";
      ++closed;
    }
  }
  return closed;
}

std::string Open(int64_t comm_id, int32_t group, int32_t rank, int32_t peer, const std::vector<uint8_t>& payload) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_comms.find(std::make_tuple(comm_id, group, rank));
  if (it == g_comms.end()) return "rank " + std::to_string(rank) + " is not registered here";
  Comm& c = *it->second;
  cudaIpcMemHandle_t h;
  if (peer < 0 || peer >= c.nranks || peer == rank || payload.size() != sizeof(h) + 16) return "bad peer or payload";
  if (c.peers[peer] != nullptr) return {};
  uint64_t pid, addr;
  std::memcpy(&h, payload.data(), sizeof(h));
  std::memcpy(&pid, payload.data() + sizeof(h), 8);
  std::memcpy(&addr, payload.data() + sizeof(h) + 8, 8);
  c.pids[peer] = static_cast<int64_t>(pid);
  c.addrs[peer] = addr;
  DeviceGuard dg(c.device);
  if (pid == static_cast<uint64_t>(getpid())) {
    c.peers[peer] = reinterpret_cast<char*>(addr);  // this process's own memory (peer access as XLA set it)
  } else {
    void* p = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e == cudaErrorAlreadyMapped) {
      cudaGetLastError();
      if (CloseStaleMappings(&c, c.device, static_cast<int64_t>(pid), addr) > 0) {
        e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) cudaGetLastError();
      }
    }
    if (e == cudaErrorAlreadyMapped)
      return "cudaIpcOpenMemHandle of rank " + std::to_string(peer) + "'s region (pid " + std::to_string(pid) +
             ") refused: CUDA counts it as mapped here already, which happens after that process freed its "
             "collective memory and allocated it again (a failure in that process) while this process still "
             "maps the old region; restart the job's processes";
    if (e != cudaSuccess)
      return CudaError(("cudaIpcOpenMemHandle of rank " + std::to_string(peer) + "'s region (pid " +
                        std::to_string(pid) + ") refused; processes in separate containers or GPUs "
                        "without peer access cannot share memory").c_str(), e);
    c.peers[peer] = static_cast<char*>(p);
    c.opened_ipc[peer] = 1;
  }
  if (++c.opened == c.nranks - 1) {
    cudaError_t e = cudaMalloc(&c.d_peers, sizeof(char*) * c.nranks);
    if (e == cudaSuccess) e = cudaMemcpy(c.d_peers, c.peers.data(), sizeof(char*) * c.nranks, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) return CudaError("peer table", e);
  }
  return {};
}

bool Registered(int64_t comm_id, int device) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_by_device.find({comm_id, device});
  return it != g_by_device.end() && it->second->d_peers != nullptr;
}

std::string CheckAll() {
  std::lock_guard<std::mutex> g(g_mu);
  std::string all;
  for (auto& [key, c] : g_comms) {
    const std::string e = TimeoutMessage(*c);
    if (!e.empty()) all += (all.empty() ? "" : "\n") + e;
  }
  return all;
}

std::string ReleaseFailed() {
  std::lock_guard<std::mutex> g(g_mu);
  for (auto& [key, c] : g_comms) {
    if (c->mine == nullptr || (c->stale.empty() && (c->err == nullptr || c->err->failed == 0))) continue;
    DeviceGuard dg(c->device);
    const std::string where = "jax_blink (CUDA IPC, device " + std::to_string(c->device) + ", collective " +
                              std::to_string(c->comm_id) + "): releasing the failed collective: ";
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();  // its kernels have ended (each wait has its budget)
    // A refused close is not an error of the reset: the collective stays failed either way.
    for (int p = 0; e == cudaSuccess && p < c->nranks; ++p) ClosePeerMapping(*c, p);
    if (e == cudaSuccess) e = cudaFree(c->d_peers);
    if (e == cudaSuccess) c->d_peers = nullptr;
    if (e == cudaSuccess) e = cudaFree(c->mine);
    if (e != cudaSuccess) return CudaError(where.c_str(), e);
    g_released.insert({c->device, reinterpret_cast<uintptr_t>(c->mine)});
    c->mine = nullptr;
    c->peers.assign(c->nranks, nullptr);
    c->opened = 0;
  }
  return {};
}

void ReleaseAll() {
  std::lock_guard<std::mutex> g(g_mu);
  for (auto& [key, c] : g_comms) {
    DeviceGuard dg(c->device);
    for (int p = 0; p < c->nranks; ++p) ClosePeerMapping(*c, p);
    cudaFree(c->d_peers);
    if (c->mine != nullptr) g_released.insert({c->device, reinterpret_cast<uintptr_t>(c->mine)});
    cudaFree(c->mine);
    cudaFreeHost(const_cast<ErrRec*>(c->err));
  }
  g_comms.clear();
  g_by_device.clear();
}

}  // namespace jax_blink::cuda_ipc

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkCollectiveIpc, jax_blink::cuda_ipc::Execute,
                              JAX_BLINK_GPU_CONTEXTS JAX_BLINK_OPERANDS JAX_BLINK_CALL_ATTRS
                                  JAX_BLINK_PROCESS_ATTRS);
