// CUDA back end of "jax_blink_collective": see cuda/executor.h and common/program.h.
//
// ## Shape
// One process drives several GPUs. A *communicator* per ordered device set enables peer access
// once per pair, loads every kernel on every device (before any kernel can wait on a peer: lazy
// loading on one GPU while a kernel spins on another has deadlocked others) and fixes the grid G.
// A *site* is one lowered call site (comm_id) on a communicator: per rank one block of device
// memory on that rank's GPU holding its call counters, its inbox of flags, its pointer table and
// its read-only plan. Nothing is staged: data moves between the ranks' own buffers, by remote
// WRITES (push) wherever the tree allows it, by in-place remote reads (pull) elsewhere.
//
// ## One call of rank r = one kernel launch (no host sync, no host rendezvous)
// The executor splits every tree's segment into *pieces* (units; <= the program's chunk, enough of
// them to fill the grid), interleaved across trees; unit u is played by block u % G on EVERY
// rank (the same mapping everywhere). Block b keeps its own call counter k (blk_seq[b] + 1,
// stored back at its end: graph replays stay right, no host state per call). Block 0 first
// publishes r's (in, out) pointers into every peer's pointer table (slot k & 1), then a release
// flag = k; a peer that sees it knows that r's kernel of call k runs, so XLA is done with r's
// buffers' previous use (stream order) and r's `out` may be written.
// Push or pull, per tree edge (child c, parent p) of a tree with a reduce phase: c PUSHES when
// it is p's only child (set-up: TreeRank.push_up / kid_push) and p's in != out in this call (c
// reads that from p's published pointers, p knows it locally: both ends decide the same way);
// otherwise p PULLS (reads c's `in`, or c's `out` once c's reduce flag says it is ready). A
// pushed contribution lands in p's `out` at the unit's range, where p then reduces in place
// (out = in op out); with in == out that would clobber p's input, hence the pull fallback.
// The broadcast always pushes: a parent writes the final unit into each child's `out` (disjoint
// regions, any number of children) and release-flags it.
// Each block then runs three passes over its units:
//   reduce pass   step (R, u), tree has reduce. A pushing child: wait for p's pointers, write its
//                 result (a leaf: its `in`; else in op its children) into p's `out`, signal p
//                 (reduce). A pulled leaf does nothing (in a reduce-only tree: out = in locally);
//                 a pulled non-leaf computes its partial result into its own `out` and signals p.
//                 A parent: wait for the pushing child's flag, or for each pulled non-leaf
//                 child's flag, then out = in op child_0 op child_1 ... (children ascending);
//                 a root with a broadcast phase writes the final unit into its `out` AND every
//                 child's `out` in the same pass (one read), then signals the children
//                 (broadcast); in a reduce-only tree a parent signals the children it pulled
//                 (reduce: "done reading you").
//   broadcast pass step (B, u), tree has broadcast, not the root of a tree with reduce: wait for
//                 the parent's broadcast flag (the data is in `out` then), push `out` into every
//                 child's `out`, signal them. The root of a broadcast-only tree: out = in locally
//                 (unless in == out) and pushes `in` into its children's `out`.
//   exit pass     a rank returns only when nobody touches its buffers any more. Writes into a
//                 rank's buffers are always followed by a flag that the rank itself waits for
//                 (the pushed contribution: p's reduce wait; the broadcast: c's broadcast wait),
//                 and every pull of a child in a tree with broadcast precedes the broadcast that
//                 the child waits for. So only a pulled child of a reduce-only tree waits here,
//                 for its parent's "done reading you".
// Elements outside every segment get out = in (local copy, spread over the grid).
//
// ## One-shot all-reduce (small and mid sizes): Mode::kLL and Mode::kOneShot
// The tree kernel's critical path is three dependent cross-GPU hops (pointers, contribution,
// result; benchmarks/NOTES.md, change 2). An all-reduce site (every tree reduces and broadcasts, no
// gaps) up to a size limit skips the trees: every rank writes its whole `in` into every peer's
// *inbox* in the communicator's staging memory, then reduces its own `in` with the peers' copies in
// rank order (0, 1, ..., n-1: every rank rounds the same way, bit-identical results). One hop, no
// pointer exchange; on 2 ranks the same link traffic as the trees (N bytes per direction).
//   kLL      16-byte lines {data0, k, data1, k ^ site}: the flag travels in the same 8-byte store
//            as its data, so a reader that sees the flags sees the data (no fence, no flag
//            store); twice the bytes on the link, so for small sizes only (any rank count <= 8).
//            The second flag carries the call site: ranks that ran different sites at call k
//            never match (reported as a mismatch at the time-out).
//   kOneShot chunks of plain 16-byte stores, then one st.release.sys flag per chunk (64-bit:
//            call number | site); pipelined per block (send chunk c + G before reducing chunk c);
//            2 ranks only (on n ranks one-shot moves n-1 copies per rank).
// The inbox has two slots per peer by call parity, and its call counter belongs to the
// communicator (shared by its one-shot sites, bumped by every one-shot call on that rank). Why two
// slots suffice without any flag back: rank A writes slot p for call k+2 only after its call k+1
// finished, which needed B's call-(k+1) data, which B sends only after its call k (the last reader
// of slot p) finished (stream order). So the staging is per communicator, not per site:
// 2 * (n-1) * region bytes per rank, region = max(2 * LL limit, one-shot limit), within
// min(1% of device memory, 256 MiB); it assumes every rank runs the communicator's one-shot sites
// in the same order (SPMD; the site tag catches violations).
//
// ## LL reduce-scatter and all-gather: Mode::kLLBlocks (cuda/ll_blocks.cuh)
// A reduce-scatter or all-gather site of n equal blocks rooted at their owners (BlockShape), each
// block at most the LL limit, skips the trees likewise: every rank writes each peer only the block
// that peer needs, as LL lines into the same inbox (same call counter, same parity slots), one hop
// instead of the trees' three.
//
// ## Host channel (Blink's hybrid transfer): Mode::kHybrid
// A 2-rank all-reduce site of at least JAX_BLINK_HOST_MIN_BYTES (256 MiB) whose call carries a
// host share (the plan's: the host path's rate against the trees', treegen.hybrid_share) sends
// the operand's last `share` of elements GPU -> pinned host memory -> GPU while the trees move
// the rest over NVLink: PCIe and NVLink are separate links, so the two add up. The tree kernel
// gets H more blocks (taken from the grid, so residency is unchanged) that do only this: each
// copies its chunks of `in` into its rank's outbox (pinned, write-combined, mapped into both
// GPUs; one per communicator and rank, shared by its hybrid sites, two slots by the parity of the
// communicator's hybrid call count), release-flags them in the peer's control block, then reads
// the peer's chunks from the peer's outbox and reduces (see host_channel). The trees' segments
// are scaled into the rest of the operand. SM-driven by default: the flags, the time budget and
// the failure path stay those of the kernel, there is no host-side sequencing, and a captured
// call replays. JAX_BLINK_HOST_ENGINE=ce moves the bytes on copy engines instead (faster both
// ways at once; enqueued per call by the host, see LaunchWithCopyEngines); the host blocks then
// only reduce what landed.
//
// ## Flags and memory order (cuda/device_sync.cuh)
// A flag lives in the memory of the rank that waits on it: inbox[src][phase][unit] on the
// waiter's GPU, written by `src` over NVLink, so every spin polls local memory. Flags hold the
// call number k (32-bit, only grows: a flag of call k-1 never satisfies a wait of call k).
// Producer: all threads store (local or, for a push, into the peer's memory); __syncthreads();
// thread 0 st.release.sys flag (cumulative: the block's stores, remote ones included, are visible
// before the flag). Consumer: thread 0 ld.acquire.sys until == k; __syncthreads(); all threads
// load with ld.global.cg (a peer's buffer, or this rank's own buffer written by a peer: never a
// stale L1 line).
// Neighbours stay within one call: for every tree edge (with units), each end needs the other's
// call k in call k (a parent reads its child's pointers to pull or to broadcast, or waits for its
// pushed flag; a child waits for the broadcast, for "done reading you", or reads the parent's
// pointers to push), so a neighbour cannot finish call k+1 before this rank started call k+1:
// while this rank runs call k, its neighbours run k or k+1. Hence (a) two pointer slots per peer
// (by call parity) suffice: slot k & 1 is not overwritten before this rank leaves call k, even
// when, as a pulled child, it reads its parent's pointers only to learn the mode, with no flag
// back; (b) an inbox flag PAST k cannot happen between ranks that run the same calls: a producer
// signals (R, u) / (B, u) of call k+1 only after it read this rank's call-(k+1) pointers, or
// after this rank passed its call-k wait on that slot (the child's next partial after the
// broadcast / "done" that followed it); so it is reported as a mismatch.
//
// ## Why it cannot deadlock
// (1) Residency: within one launch no block waits on another block of its own grid, and the grid
// (G blocks, one per SM by default, launch_bounds(512, 1)) is checked to be resident at once on
// every device (N ranks sharing one GPU need N * G resident; set-up checks it). So every block
// of every rank runs to its waits. (2) Order: block b of every rank runs the same steps in the
// same order: (pass, unit) for the units u = b mod G. A reduce step (R, u) waits only for the
// children's (R, u) (pulled leaf children: for nothing) and for pointers (children's, and the
// parent's when pushing), which block 0 publishes before any wait; a broadcast step (B, u) waits
// only for the parent's (B, u) (the root's (B, u) is done within its (R, u)) and for the
// children's pointers; exit waits wait for steps of earlier passes. Take a blocked wait on the
// smallest step key K: its producer's block b is not past K, runs its steps in order and every
// earlier step of it completes (minimality), so it waits at K itself; within a key the waits
// follow tree edges in one direction (down for R, up for B), and trees are acyclic (validated by
// common/program.h), so the chain ends at a leaf (R) or the root (B), which do not wait: contradiction.
// Different sites are independent; if they ran in different orders on different devices, the
// time budget ends it.
//
// ## Failures
// Every wait has a budget (timeout_ms, %globaltimer, renewed after each completed wait). Past it
// the block writes an abort marker (its call number) into every peer's `abort_` word, claims the
// device's error slot (device-memory CAS: the first failure on a device wins) and fills the
// device's error record in host-mapped pinned memory (device, rank, peer, tree, chunk, phase,
// call), then stops. Waiters poll the producer's abort marker and their device's claim, so a
// failure cascades in microseconds instead of each rank waiting out its own budget. Failures are
// sticky: every later kernel on a failed device exits at once (and marks its peers aborted; a
// one-rank call, which waits for nobody, still copies its operand: Launch), the handler
// refuses calls on it with the recorded message, and ResetAll() (reset() of cuda/module.cc)
// clears everything once nothing runs. A rank that skipped a call: its peers time out (record),
// then its next call sees their abort markers and fails too.

#include "cuda/executor.h"

#include <cuda.h>  // stream memory operations (through cudaGetDriverEntryPointByVersion: no -lcuda)
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <strings.h>  // strcasecmp
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>  // the communicator's key (devices, blocks, lane)
#include <type_traits>
#include <utility>
#include <vector>

#include "common/program.h"
#include "cuda/device_kernels.cuh"  // the device side: layouts shared with the host, the kernels

namespace jax_blink::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Host state.

std::string CudaErr(const char* what, cudaError_t e) {
  return std::string("jax_blink CUDA executor: ") + what + ": " + cudaGetErrorName(e) + " (" +
         cudaGetErrorString(e) + ")";
}

#define JB_TRY(what, expr)                         \
  do {                                             \
    cudaError_t e_ = (expr);                       \
    if (e_ != cudaSuccess) return CudaErr(what, e_); \
  } while (0)

struct DeviceGuard {  // restores the calling thread's current device
  int saved = -1;
  DeviceGuard() { cudaGetDevice(&saved); }
  ~DeviceGuard() { if (saved >= 0) cudaSetDevice(saved); }
};

// The kernels (tree, LL, one-shot, two-shot, LL blocks), indexed by KernelIndex(mode).
constexpr int kNumKernels = 5;
constexpr int KernelIndex(Mode m) {
  return m == Mode::kLL ? 1 : m == Mode::kOneShot ? 2 : m == Mode::kTwoShot ? 3 : m == Mode::kLLBlocks ? 4 : 0;
}

struct DeviceState {
  int device = -1;
  ErrorRecord* rec = nullptr;     // host pointer (mapped)
  ErrorRecord* rec_dev = nullptr; // its device pointer
  uint32_t* claim = nullptr;      // device memory
  cudaStream_t stream = nullptr;  // set-up work
  int sms = 0, occupancy = 0;     // multiprocessors, resident blocks of our kernels per SM
  // Every kernel's driver handle in this device's primary context, fetched when the kernels are
  // loaded: a call launches it with cuLaunchKernel, without the runtime's per-launch lookup of
  // the current device and of the function (the launch is most of a small call's cost: benchmarks/NOTES.md, change 7).
  CUfunction fn[kNumKernels][kNumDTypes][kNumOps] = {};
  CUfunction one_rank = nullptr;  // one_rank_kernel
};

// A driver API function (CUDA 12 ABI), fetched through the runtime: no link against libcuda.
// "" and *f set, or the reason it is not there.
std::string DriverEntry(const char* name, void** f) {
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  *f = nullptr;
  if (cudaError_t e = cudaGetDriverEntryPointByVersion(name, f, 12000, cudaEnableDefault, &q); e != cudaSuccess) {
    cudaGetLastError();
    return CudaErr((std::string("cudaGetDriverEntryPointByVersion (") + name + ")").c_str(), e);
  }
  if (q != cudaDriverEntryPointSuccess || *f == nullptr)
    return std::string("jax_blink CUDA executor: the CUDA driver has no ") + name + " (driver too old?)";
  return {};
}

// cuLaunchKernel, fetched at the first device set-up.
using LaunchKernelFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    CUstream, void**, void**);
std::atomic<LaunchKernelFn> g_launch_kernel{nullptr};

std::string LoadLaunchKernel() {
  if (g_launch_kernel.load(std::memory_order_acquire) != nullptr) return {};
  void* f = nullptr;
  if (std::string err = DriverEntry("cuLaunchKernel", &f); !err.empty()) return err;
  g_launch_kernel.store(reinterpret_cast<LaunchKernelFn>(f), std::memory_order_release);
  return {};
}

struct Comm {
  std::vector<int> devices;
  int blocks = 0;
  std::vector<Site*> sites;
  // One-shot staging, one block per rank (Params::stg layout), made at the first one-shot site.
  bool stg_made = false;
  std::vector<uint8_t*> stg;
  size_t stg_bytes = 0, stg_dyn = 0;  // [stg_dyn, stg_bytes): counters, flags, data (zeroed by reset)
  uint64_t off_seq = 0, off_flags = 0, off_data = 0, region = 0;  // region 0: no one-shot on this comm
  int64_t max_chunks = 0;
  // Host channel (Mode::kHybrid), made at the first hybrid site: per rank an outbox in pinned host
  // memory (two slots of host_slot bytes) and a control block in device memory (Params::hctl_*).
  bool host_made = false;
  std::vector<void*> host_buf, host_dev;
  std::vector<uint32_t*> hctl;
  uint64_t host_slot = 0;
  int64_t host_max_chunks = 0;
  size_t hctl_bytes = 0;
  // Copy engines for the host channel (Params::host_ce), made at the first such site: per rank a
  // landing buffer in device memory, the ready flags in pinned host memory, two side streams
  // (to host, from host), the events that fork them from and join them to the call's stream, the
  // communicator's hybrid call count (host side) and a lock around one call's enqueueing.
  bool ce_made = false;
  bool host_ce = false;  // the engine of its host channel, fixed by its first hybrid site: sites of
                         // both kinds would count the slot parity apart
  uint64_t stage_bytes = 0;
  struct CopyEngines {
    uint8_t* stage = nullptr;
    uint32_t* ready_host = nullptr;  // pinned
    uint32_t* ready_dev = nullptr;   // its device pointer
    cudaStream_t to_host = nullptr, from_host = nullptr;
    cudaEvent_t fork = nullptr, joined_to = nullptr, joined_from = nullptr;
    uint32_t calls = 0;
    std::mutex mu;
  };
  std::vector<std::unique_ptr<CopyEngines>> ce;
};

}  // namespace

struct Site {
  Comm* comm = nullptr;
  int rank = 0, nranks = 0, device = 0, esize = 0, grid = 1;
  bool host_ce = false;  // kHybrid through copy engines (Launch enqueues the copies)
  bool twoshot_ce = false;  // kTwoShot whose caller runs the copy engines' form (JAX_BLINK_TWOSHOT_ENGINE=ce)
  Mode mode = Mode::kTree;
  int64_t total = 0, units = 0;
  std::vector<int32_t> words;
  std::atomic<const int32_t*> last_ptr{nullptr};
  CUfunction fn[kNumDTypes][kNumOps] = {};  // its kernel per dtype and op, on its device (DeviceState::fn)
  CUfunction one_rank = nullptr;            // one rank: the copy (DeviceState::one_rank)
  unsigned copy_threads = 0;                // its block size (one_rank_kernel)
  Params params{};
  uint8_t* mem = nullptr;
  size_t mem_bytes = 0, dyn_bytes = 0;  // [0, dyn_bytes): counters, flags, tables (zeroed by reset)
  uint64_t launches = 0;  // JAX_BLINK_LOG_BUFFERS: this rank's logged launches since set-up (not reset)
};

namespace {

std::mutex g_mu;
std::atomic<DeviceState*> g_dev[kMaxDevices];
std::map<std::tuple<std::vector<int>, int, int>, std::unique_ptr<Comm>> g_comms;  // (devices, blocks, lane)
std::vector<std::unique_ptr<Site>> g_sites;
std::map<std::pair<int64_t, int>, Site*> g_site_by_dev;  // (comm_id, device)

struct Pending {
  std::vector<int32_t> words;
  int nranks = 0;
  std::vector<int> devices;  // -1: not joined yet
  int joined = 0;
  bool done = false;
  std::string error;
  std::vector<Site*> sites;
  std::condition_variable cv;
};
std::map<std::pair<int64_t, int32_t>, std::shared_ptr<Pending>> g_pending;  // (comm_id, group)

std::string EnsureDeviceLocked(int d, DeviceState** out) {
  if (d < 0 || d >= kMaxDevices) return "jax_blink CUDA executor: device ordinal " + std::to_string(d) + " out of range";
  if (DeviceState* s = g_dev[d].load()) { *out = s; return {}; }
  auto s = std::make_unique<DeviceState>();
  s->device = d;
  JB_TRY("cudaSetDevice", cudaSetDevice(d));
  JB_TRY("cudaDeviceGetAttribute", cudaDeviceGetAttribute(&s->sms, cudaDevAttrMultiProcessorCount, d));
  // Load every kernel on this device now, before any kernel of ours can wait on a peer.
  if (std::string err = LoadLaunchKernel(); !err.empty()) return err;
  int occ = 1 << 30;
  for (int dt = 0; dt < kNumDTypes; ++dt)
    for (int op = 0; op < kNumOps; ++op)
      for (Mode m : kModes) {
        KernelFn fn = KernelFor(static_cast<DType>(dt), op, m);
        cudaFuncAttributes attr;
        JB_TRY("loading kernels (cudaFuncGetAttributes)", cudaFuncGetAttributes(&attr, fn));
        cudaFunction_t handle = nullptr;
        JB_TRY("cudaGetFuncBySymbol", cudaGetFuncBySymbol(&handle, reinterpret_cast<const void*>(fn)));
        s->fn[KernelIndex(m)][dt][op] = reinterpret_cast<CUfunction>(handle);
        int nb = 0;
        JB_TRY("cudaOccupancyMaxActiveBlocksPerMultiprocessor",
               cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, kThreads, 0));
        occ = std::min(occ, nb);
      }
  {
    cudaFunction_t handle = nullptr;
    JB_TRY("cudaGetFuncBySymbol", cudaGetFuncBySymbol(&handle, reinterpret_cast<const void*>(&one_rank_kernel)));
    s->one_rank = reinterpret_cast<CUfunction>(handle);
  }
  if (occ < 1) return "jax_blink CUDA executor: the collective kernel cannot be resident on device " + std::to_string(d);
  s->occupancy = occ;
  void* h = nullptr;
  JB_TRY("cudaHostAlloc (error record)", cudaHostAlloc(&h, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(h, 0, sizeof(ErrorRecord));
  s->rec = static_cast<ErrorRecord*>(h);
  void* hd = nullptr;
  JB_TRY("cudaHostGetDevicePointer", cudaHostGetDevicePointer(&hd, h, 0));
  s->rec_dev = static_cast<ErrorRecord*>(hd);
  JB_TRY("cudaMalloc (claim)", cudaMalloc(&s->claim, 256));
  JB_TRY("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
  JB_TRY("cudaMemsetAsync", cudaMemsetAsync(s->claim, 0, 256, s->stream));
  JB_TRY("cudaStreamSynchronize", cudaStreamSynchronize(s->stream));
  *out = s.get();
  g_dev[d].store(s.release());
  return {};
}

// Environment variables (README "Options"), checked as a whole by CheckEnvironment().
const char* EnvValue(const char* name) {  // nullptr when unset or empty
  const char* e = std::getenv(name);
  return (e != nullptr && *e != 0) ? e : nullptr;
}
// True when variable `name` is `value` (any case): a two-choice variable's non-default choice.
bool EnvIs(const char* name, const char* value) {
  const char* e = EnvValue(name);
  return e != nullptr && strcasecmp(e, value) == 0;
}
// The readers below keep their defaults for values CheckEnvironment() refuses: set-up returns its
// message before any of them is used.
int64_t EnvBytes(const char* name, int64_t fallback) {
  int64_t v = 0;
  const char* e = EnvValue(name);
  return (e != nullptr && ParseByteCount(e, &v)) ? v : fallback;
}
bool EnvCount(const char* name, int64_t lo, int64_t hi, int64_t* out) {  // a plain integer in [lo, hi]
  const char* e = EnvValue(name);
  if (e == nullptr || *e < '0' || *e > '9') return false;  // digits only: no sign, no blank
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(e, &end, 10);
  if (end == e || *end != 0 || errno != 0 || v < lo || v > hi) return false;
  *out = v;
  return true;
}
bool EnvShare(double* out) {  // JAX_BLINK_HOST_SHARE: a fraction in [0, 1]
  const char* e = EnvValue("JAX_BLINK_HOST_SHARE");
  // Plain decimal ("0.09", ".5", "1e-1"): strtod alone would also take blanks, signs, hex, inf.
  if (e == nullptr || std::strchr("0123456789.", *e) == nullptr || e[std::strspn(e, "0123456789.eE+-")] != 0)
    return false;
  char* end = nullptr;
  const double v = std::strtod(e, &end);
  if (end == e || *end != 0 || !(v >= 0.0 && v <= 1.0)) return false;
  *out = v;
  return true;
}
constexpr int64_t kMaxCudaBlocks = 1 << 16;

std::string GetCommLocked(const std::vector<int>& devices, const Options& opt, Comm** out) {
  int blocks = opt.blocks;
  if (blocks <= 0) {
    int64_t env_blocks = 0;  // 0: one block per SM of the smallest GPU
    EnvCount("JAX_BLINK_CUDA_BLOCKS", 0, kMaxCudaBlocks, &env_blocks);
    blocks = static_cast<int>(env_blocks);
  }
  auto key = std::make_tuple(devices, std::max(blocks, 0), opt.lane);  // lane: Options::lane (async_ffi.cc)
  auto it = g_comms.find(key);
  if (it != g_comms.end()) { *out = it->second.get(); return {}; }
  DeviceGuard guard;
  std::map<int, int> ranks_on;
  int min_sms = 1 << 30;
  for (int d : devices) {
    DeviceState* ds;
    std::string err = EnsureDeviceLocked(d, &ds);
    if (!err.empty()) return err;
    ++ranks_on[d];
    min_sms = std::min(min_sms, ds->sms);
  }
  // Peer access, once per ordered pair of distinct devices.
  for (auto& [a, na] : ranks_on)
    for (auto& [b, nb] : ranks_on) {
      if (a == b) continue;
      int can = 0;
      JB_TRY("cudaDeviceCanAccessPeer", cudaDeviceCanAccessPeer(&can, a, b));
      if (!can)
        return "jax_blink CUDA executor: GPU " + std::to_string(a) + " cannot access GPU " + std::to_string(b) +
               " as a peer (no NVLink/PCIe peer path): this executor needs peer access between all GPUs of a collective";
      JB_TRY("cudaSetDevice", cudaSetDevice(a));
      cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();  // clear the sticky error
      else if (e != cudaSuccess) return CudaErr("cudaDeviceEnablePeerAccess", e);
    }
  if (blocks <= 0) blocks = min_sms;
  for (auto& [d, nr] : ranks_on) {
    DeviceState* ds = g_dev[d].load();
    if (static_cast<int64_t>(nr) * blocks > static_cast<int64_t>(ds->sms) * ds->occupancy)
      return "jax_blink CUDA executor: " + std::to_string(nr) + " ranks of " + std::to_string(blocks) +
             " blocks each on GPU " + std::to_string(d) + " cannot all be resident (" +
             std::to_string(ds->sms * ds->occupancy) + " blocks fit): use fewer blocks (Options.blocks / JAX_BLINK_CUDA_BLOCKS)";
  }
  auto c = std::make_unique<Comm>();
  c->devices = devices;
  c->blocks = blocks;
  *out = c.get();
  g_comms[key] = std::move(c);
  return {};
}

size_t AlignUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// The one-shot kernels' limits and chunking (README "Options"), read at each site's set-up.
int64_t DefaultTwoShotMin() { return EnvBytes("JAX_BLINK_TWOSHOT_MIN_BYTES", kDefaultTwoShotMinBytes); }
int64_t TwoShotPieceBytes() { return std::max<int64_t>(16, EnvBytes("JAX_BLINK_TWOSHOT_PIECE_BYTES", kTwoShotPieceBytes)); }
// JAX_BLINK_TWOSHOT_ENGINE: sm (the kernel, default) or ce (copy engines).
bool TwoShotOnCopyEngines() { return EnvIs("JAX_BLINK_TWOSHOT_ENGINE", "ce"); }
// JAX_BLINK_TWOSHOT_PUSH: serial (each peer's whole piece in turn, default) or spread.
bool TwoShotPushSpread() { return EnvIs("JAX_BLINK_TWOSHOT_PUSH", "spread"); }
// JAX_BLINK_TWOSHOT_MODE: auto (push unless an operand aliases its result, default) or pull.
bool TwoShotPullAlways() { return EnvIs("JAX_BLINK_TWOSHOT_MODE", "pull"); }
// JAX_BLINK_TWOSHOT_REDUCERS (checked by CheckEnvironment), at most a quarter of the grid `G`.
int TwoShotReducers(int G) {
  int64_t v = kTwoShotReducers;
  if (EnvValue("JAX_BLINK_TWOSHOT_REDUCERS") != nullptr && !EnvCount("JAX_BLINK_TWOSHOT_REDUCERS", 0, kMaxCudaBlocks, &v))
    v = kTwoShotReducers;
  return static_cast<int>(std::min<int64_t>(v, G / 4));
}
int64_t DefaultLLMax() { return EnvBytes("JAX_BLINK_LL_BYTES", kDefaultLLMaxBytes); }
int64_t DefaultOneShotMax(int n) { return n == 2 ? EnvBytes("JAX_BLINK_ONESHOT_BYTES", kDefaultOneShotMaxBytes) : 0; }

// The largest tail of at most `elems` of `total` elements that starts at a multiple of `align`.
int64_t SliceFromAlignedStart(int64_t total, int64_t elems, int64_t align) {
  return total - static_cast<int64_t>(AlignUp(static_cast<size_t>(total - elems), static_cast<size_t>(align)));
}

// The host channel of a site (Mode::kHybrid), decided at set-up.
struct HostSlice {
  int64_t elems = 0;   // the operand's last `elems` elements take the host channel (0: none)
  int64_t chunk = 0;   // elements per chunk (the unit of flags)
  int blocks = 0;      // blocks of the kernel that drive it
  int64_t max_bytes = 0;  // the outbox slot this wants (the communicator's is made once)
  bool ce = false;     // copy engines move the chunks (JAX_BLINK_HOST_ENGINE=ce), else the SMs
};

// Whether and how much of a site goes through pinned host memory: a 2-rank all-reduce of at
// least the minimum size with a positive share (JAX_BLINK_HOST_SHARE overrides the plan's), the
// slice within host_max bytes, 16-byte aligned, and at least one block left for the trees.
HostSlice PlanHostSlice(const Options& opt, int n, bool allreduce, int64_t total, int esize, int grid) {
  HostSlice h;
  double share = opt.host_share;
  EnvShare(&share);  // overrides the plan's
  const int64_t payload = total * esize;
  const int64_t min_bytes = opt.host_min_bytes >= 0 ? opt.host_min_bytes : EnvBytes("JAX_BLINK_HOST_MIN_BYTES", kDefaultHostMinBytes);
  const int64_t max_bytes = opt.host_max_bytes >= 0 ? opt.host_max_bytes : EnvBytes("JAX_BLINK_HOST_MAX_BYTES", kDefaultHostMaxBytes);
  int64_t env_blocks = kDefaultHostBlocks;
  EnvCount("JAX_BLINK_HOST_BLOCKS", 0, kMaxCudaBlocks, &env_blocks);
  int blocks = opt.host_blocks >= 0 ? opt.host_blocks : static_cast<int>(env_blocks);
  int engine = opt.host_engine;
  if (engine < 0) {
    engine = EnvValue("JAX_BLINK_HOST_ENGINE") == nullptr ? kDefaultHostEngine : EnvIs("JAX_BLINK_HOST_ENGINE", "ce");
  }
  h.ce = engine == 1;
  const int64_t chunk_bytes = opt.host_chunk_bytes > 0
                                  ? opt.host_chunk_bytes
                                  : EnvBytes("JAX_BLINK_HOST_CHUNK_BYTES", h.ce ? kDefaultHostCEChunkBytes : kDefaultHostChunkBytes);
  if (n != 2 || !allreduce || !(share > 0) || payload < std::max<int64_t>(min_bytes, 1) || blocks < 1 || grid < 2) return h;
  const int64_t align = std::max(1, 16 / esize);
  int64_t elems = static_cast<int64_t>(std::min(share, 1.0) * static_cast<double>(total));
  elems = std::min(elems, std::max<int64_t>(max_bytes, 0) / esize) / align * align;
  // The trees keep at least one 16-byte atom: their per-site flags are what tells two ranks that
  // ran different hybrid sites at the same host-channel call apart (a time-out, never a silent
  // mix); and the slice starts 16-byte aligned (the vector paths), so it ends where the operand does.
  elems = SliceFromAlignedStart(total, std::min(elems, (total - 1) / align * align), align);
  if (elems <= 0) return h;
  h.elems = elems;
  h.chunk = std::max<int64_t>(align, std::max<int64_t>(chunk_bytes, 4096) / esize / align * align);
  const int64_t nch = (elems + h.chunk - 1) / h.chunk;
  h.blocks = static_cast<int>(std::min<int64_t>({static_cast<int64_t>(blocks), static_cast<int64_t>(grid - 1), nch}));
  h.max_bytes = max_bytes;
  return h;
}

// Device memory a communicator may stage in, per rank: min(1% of its smallest device, 256 MiB).
std::string StagingBudget(const Comm* c, uint64_t* budget) {
  DeviceGuard guard;
  size_t mem_min = SIZE_MAX;
  for (int d : c->devices) {
    size_t free_b = 0, total_b = 0;
    JB_TRY("cudaSetDevice", cudaSetDevice(d));
    JB_TRY("cudaMemGetInfo", cudaMemGetInfo(&free_b, &total_b));
    mem_min = std::min(mem_min, total_b);
  }
  *budget = std::min<uint64_t>(mem_min / 100, uint64_t{256} << 20);
  return {};
}

// The communicator's one-shot staging: per rank 2 * (n-1) inbox slots of `region` bytes (sized
// for the default limits) and their chunk flags, within min(1% of the smallest device's memory,
// 256 MiB); halved until it fits (region 0: one-shot off on this communicator).
std::string EnsureStagingLocked(Comm* c) {
  if (c->stg_made) return {};
  const int n = static_cast<int>(c->devices.size());
  DeviceGuard guard;
  uint64_t budget = 0;
  std::string berr = StagingBudget(c, &budget);
  if (!berr.empty()) return berr;
  const uint64_t slots = 2ull * (n - 1);
  uint64_t region = AlignUp(static_cast<size_t>(std::max<int64_t>(2 * std::min<int64_t>(DefaultLLMax(), int64_t{1} << 30),
                                                                  DefaultOneShotMax(n))), 4096);
  if (n < 2 || n > kMaxRanks) region = 0;
  auto chunks_for = [](uint64_t r) { return static_cast<int64_t>(r / kMinOneShotChunk + 1); };
  auto total_for = [&](uint64_t r) { return slots * (r + 8ull * chunks_for(r)); };
  while (region > 0 && total_for(region) > budget) region = region / 2 / 4096 * 4096;
  c->region = region;
  c->max_chunks = region > 0 ? chunks_for(region) : 0;
  c->off_seq = AlignUp(8ull * n, 128);
  c->off_flags = AlignUp(c->off_seq + 4ull * c->blocks, 128);
  c->off_data = AlignUp(c->off_flags + 8ull * slots * c->max_chunks, 256);
  c->stg_bytes = region > 0 ? AlignUp(c->off_data + slots * region, 256) : 0;
  c->stg_dyn = c->off_seq;
  c->stg.assign(n, nullptr);
  if (region > 0) {
    for (int r = 0; r < n; ++r) {
      JB_TRY("cudaSetDevice", cudaSetDevice(c->devices[r]));
      JB_TRY("cudaMalloc (one-shot staging)", cudaMalloc(&c->stg[r], c->stg_bytes));
    }
    std::vector<uint64_t> peers(n);
    for (int r = 0; r < n; ++r) peers[r] = reinterpret_cast<uint64_t>(c->stg[r]);
    for (int r = 0; r < n; ++r) {
      DeviceState* ds = g_dev[c->devices[r]].load();
      JB_TRY("cudaSetDevice", cudaSetDevice(c->devices[r]));
      JB_TRY("cudaMemcpyAsync (staging peers)", cudaMemcpyAsync(c->stg[r], peers.data(), 8 * n, cudaMemcpyHostToDevice, ds->stream));
      JB_TRY("cudaMemsetAsync (staging)", cudaMemsetAsync(c->stg[r] + c->stg_dyn, 0, c->stg_bytes - c->stg_dyn, ds->stream));
      JB_TRY("cudaStreamSynchronize (staging)", cudaStreamSynchronize(ds->stream));
    }
  }
  c->stg_made = true;
  return {};
}

void FreeHostChannel(Comm* c) {
  for (size_t r = 0; r < c->hctl.size(); ++r) {
    if (c->host_buf[r] != nullptr) cudaFreeHost(c->host_buf[r]);
    if (c->hctl[r] != nullptr) { cudaSetDevice(c->devices[r]); cudaFree(c->hctl[r]); }
  }
  c->host_buf.clear();
  c->host_dev.clear();
  c->hctl.clear();
  c->host_made = false;
}

// The communicator's host channel (2 ranks): per rank an outbox of two slots of host_max_bytes
// in pinned, portable, mapped, write-combined host memory (no CPU reads it, and the GPUs' PCIe
// accesses need not snoop the CPU caches), and a zeroed control block in device memory (call
// counters for the grid, flags for the smallest chunk, 4 KiB). Host memory, so outside the
// device staging budget; reported by Comms().
std::string EnsureHostChannelLocked(Comm* c, int64_t max_bytes, bool copy_engines) {
  if (c->host_made) return {};
  c->host_ce = copy_engines;
  const int n = static_cast<int>(c->devices.size());
  if (n != 2) return "jax_blink CUDA executor: internal: the host channel needs 2 ranks";
  DeviceGuard guard;
  c->host_slot = AlignUp(static_cast<size_t>(std::max<int64_t>(max_bytes, 4096)), 4096);
  c->host_max_chunks = static_cast<int64_t>(c->host_slot / 4096) + 1;
  // counters [blocks], then flags [2][max_chunks] (SM: ready; copy engines: landed), then the
  // copy engines' sent flags [2][max_chunks]
  c->hctl_bytes = 4ull * c->blocks + 4ull * 4 * c->host_max_chunks;
  c->host_buf.assign(n, nullptr);
  c->host_dev.assign(n, nullptr);
  c->hctl.assign(n, nullptr);
  for (int r = 0; r < n; ++r) {
    DeviceState* ds = g_dev[c->devices[r]].load();
    cudaError_t e = cudaSetDevice(c->devices[r]);
    if (e == cudaSuccess)
      e = cudaHostAlloc(&c->host_buf[r], 2 * c->host_slot,
                        cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined);
    if (e == cudaSuccess) e = cudaHostGetDevicePointer(&c->host_dev[r], c->host_buf[r], 0);
    if (e == cudaSuccess) e = cudaMalloc(&c->hctl[r], c->hctl_bytes);
    if (e == cudaSuccess) e = cudaMemsetAsync(c->hctl[r], 0, c->hctl_bytes, ds->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(ds->stream);
    if (e != cudaSuccess) {
      FreeHostChannel(c);
      return CudaErr("setting up the host channel (pinned outbox, control block)", e);
    }
  }
  c->host_made = true;
  return {};
}

// Stream memory operations (driver API, fetched through the runtime: no link against libcuda).
using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
StreamValueFn g_wait_value = nullptr, g_write_value = nullptr;

std::string LoadStreamMemOps() {
  if (g_wait_value != nullptr && g_write_value != nullptr) return {};
  void* w = nullptr;
  void* v = nullptr;
  for (auto [name, f] : {std::pair{"cuStreamWaitValue32", &w}, std::pair{"cuStreamWriteValue32", &v}})
    if (std::string err = DriverEntry(name, f); !err.empty())
      return err + ": no stream memory operations; use the SM host channel (JAX_BLINK_HOST_ENGINE=sm)";
  g_wait_value = reinterpret_cast<StreamValueFn>(w);
  g_write_value = reinterpret_cast<StreamValueFn>(v);
  return {};
}

// The copy engines' share of the host channel (after EnsureHostChannelLocked): per rank a landing
// buffer of `stage` bytes in device memory (it counts as staging: at most half the staging
// budget), ready flags in pinned host memory, side streams and events.
std::string MakeCopyEnginesLocked(Comm* c);
void FreeCopyEngines(Comm* c);

std::string EnsureCopyEnginesLocked(Comm* c) {
  if (c->ce_made) return {};
  std::string err = MakeCopyEnginesLocked(c);
  if (!err.empty()) FreeCopyEngines(c);
  return err;
}

std::string MakeCopyEnginesLocked(Comm* c) {
  std::string err = LoadStreamMemOps();
  if (!err.empty()) return err;
  const int n = static_cast<int>(c->devices.size());
  DeviceGuard guard;
  uint64_t budget = 0;
  std::string berr = StagingBudget(c, &budget);
  if (!berr.empty()) return berr;
  c->stage_bytes = std::min<uint64_t>(c->host_slot, budget / 2 / 4096 * 4096);
  c->ce.clear();
  for (int r = 0; r < n; ++r) {
    auto e = std::make_unique<Comm::CopyEngines>();
    Comm::CopyEngines& x = *e;
    c->ce.push_back(std::move(e));
    JB_TRY("cudaSetDevice", cudaSetDevice(c->devices[r]));
    JB_TRY("cudaMalloc (host channel landing buffer)", cudaMalloc(&x.stage, c->stage_bytes));
    void* h = nullptr;
    JB_TRY("cudaHostAlloc (host channel ready flags)",
           cudaHostAlloc(&h, 8ull * c->host_max_chunks, cudaHostAllocPortable | cudaHostAllocMapped));
    std::memset(h, 0, 8ull * c->host_max_chunks);
    x.ready_host = static_cast<uint32_t*>(h);
    void* hd = nullptr;
    JB_TRY("cudaHostGetDevicePointer", cudaHostGetDevicePointer(&hd, h, 0));
    x.ready_dev = static_cast<uint32_t*>(hd);
    JB_TRY("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&x.to_host, cudaStreamNonBlocking));
    JB_TRY("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&x.from_host, cudaStreamNonBlocking));
    JB_TRY("cudaEventCreateWithFlags", cudaEventCreateWithFlags(&x.fork, cudaEventDisableTiming));
    JB_TRY("cudaEventCreateWithFlags", cudaEventCreateWithFlags(&x.joined_to, cudaEventDisableTiming));
    JB_TRY("cudaEventCreateWithFlags", cudaEventCreateWithFlags(&x.joined_from, cudaEventDisableTiming));
  }
  c->ce_made = true;
  return {};
}

void FreeCopyEngines(Comm* c) {
  for (size_t r = 0; r < c->ce.size(); ++r) {
    Comm::CopyEngines& x = *c->ce[r];
    cudaSetDevice(c->devices[r]);
    if (x.stage) cudaFree(x.stage);
    if (x.ready_host) cudaFreeHost(x.ready_host);
    if (x.to_host) cudaStreamDestroy(x.to_host);
    if (x.from_host) cudaStreamDestroy(x.from_host);
    for (cudaEvent_t ev : {x.fork, x.joined_to, x.joined_from})
      if (ev) cudaEventDestroy(ev);
  }
  c->ce.clear();
  c->ce_made = false;
}

// ---------------------------------------------------------------------------------------------
// Making a site, step by step (CreateSiteLocked at the end puts them together).

// The program and the devices agree, and the executor can run them.
std::string CheckSiteRequest(const Program& prog, const std::vector<int>& devices, int esize) {
  const int n = prog.nranks();
  if (n != static_cast<int>(devices.size()))
    return "jax_blink CUDA executor: the program has " + std::to_string(n) + " ranks but " +
           std::to_string(devices.size()) + " devices were given";
  if (n > kMaxRanks) return "jax_blink CUDA executor: at most " + std::to_string(kMaxRanks) + " ranks";
  if (esize != 2 && esize != 4 && esize != 8) return "jax_blink CUDA executor: element size must be 2, 4 or 8";
  return {};
}

// An all-reduce: the trees with elements all reduce and broadcast and cover the operand. Only such
// a site may skip the trees (one-shot) or send a share through host memory (hybrid).
bool IsAllReduce(const Program& prog) {
  if (prog.nranks() < 2) return false;
  int64_t at = 0;
  bool any = false;
  for (int t : prog.trees_by_offset()) {
    const TreeView& tv = prog.tree(t);
    if (tv.seg_len == 0) continue;
    any = true;
    if (tv.seg_offset != at || tv.phases != (kPhaseReduce | kPhaseBroadcast)) return false;
    at = tv.seg_offset + tv.seg_len;
  }
  return any && at == prog.total_elems();
}

// The host channel of an all-reduce site (Mode::kHybrid): PlanHostSlice's wish, made to fit the
// communicator's channel, which its first hybrid site sets up (outbox size, engine) for all.
// Returns an empty HostSlice where the site takes NVLink only.
std::string FitHostSliceLocked(Comm* comm, const Options& opt, const Program& prog, bool allreduce, int esize,
                               HostSlice* out) {
  const int64_t total = prog.total_elems();
  const int64_t align = std::max(1, 16 / esize);
  HostSlice host = PlanHostSlice(opt, prog.nranks(), allreduce, total, esize, comm->blocks);
  *out = HostSlice{};
  if (host.elems <= 0) return {};
  if (std::string err = EnsureHostChannelLocked(comm, host.max_bytes, host.ce); !err.empty()) return err;
  if (host.ce && !comm->ce_made) {
    if (std::string err = EnsureCopyEnginesLocked(comm); !err.empty()) {
      if (std::none_of(comm->sites.begin(), comm->sites.end(), [](const Site* x) { return x->mode == Mode::kHybrid; }))
        comm->host_ce = false;  // no hybrid site uses the channel yet: a later SM site may
      return err;
    }
  }
  // The channel runs on one engine (its first hybrid site's): a site that asks for the other one
  // (the command-buffer handler asks for SMs) takes NVLink only.
  if (host.ce != comm->host_ce) return {};
  const uint64_t room = host.ce ? std::min<uint64_t>(comm->host_slot, comm->stage_bytes) : comm->host_slot;
  if (host.elems > static_cast<int64_t>(room) / esize)  // capped: start 16-byte aligned again
    host.elems = SliceFromAlignedStart(total, static_cast<int64_t>(room) / esize / align * align, align);
  if (host.elems <= 0) return {};
  // Copy engines: at most kMaxCEChunks chunks per call. Each chunk is three operations on the
  // receiving side stream that wait for the peer, and a stream holds only so many pending ones
  // before enqueueing blocks the host thread, which may be the one yet to launch the peer
  // (benchmarks/NOTES.md, "Copy-engine chunks per call").
  if (host.ce) host.chunk = std::max(host.chunk, ((host.elems + kMaxCEChunks - 1) / kMaxCEChunks + align - 1) / align * align);
  host.blocks = static_cast<int>(std::min<int64_t>(host.blocks, (host.elems + host.chunk - 1) / std::max<int64_t>(host.chunk, 1)));
  *out = host;
  return {};
}

// The trees' segments as the site runs them: the program's, or, where the host channel takes the
// operand's last host_elems elements, scaled into what is left, [0, nv_total), keeping their order
// and proportions (16-byte aligned starts, for the vector paths).
void SegmentsBeforeHostSlice(const Program& prog, int64_t nv_total, int64_t align, std::vector<int64_t>* seg_off,
                             std::vector<int64_t>* seg_len) {
  const int ntrees = prog.ntrees();
  seg_off->resize(ntrees);
  seg_len->resize(ntrees);
  for (int t = 0; t < ntrees; ++t) {
    (*seg_off)[t] = prog.tree(t).seg_offset;
    (*seg_len)[t] = prog.tree(t).seg_len;
  }
  if (nv_total == prog.total_elems()) return;
  std::vector<int> order;
  for (int t : prog.trees_by_offset())
    if ((*seg_len)[t] > 0) order.push_back(t);
  std::vector<int64_t> lo(order.size() + 1, nv_total);
  for (size_t i = 0; i < order.size(); ++i)
    lo[i] = i == 0 ? 0
                   : static_cast<int64_t>(static_cast<__int128>((*seg_off)[order[i]]) * nv_total / prog.total_elems()) /
                         align * align;
  for (size_t i = 0; i < order.size(); ++i) {
    (*seg_off)[order[i]] = lo[i];
    (*seg_len)[order[i]] = std::max<int64_t>(0, lo[i + 1] - lo[i]);
  }
}

// Pieces (units): U = m * blocks units (m rounds per block) of at most the program's chunk, no
// smaller than min_piece_bytes, each tree a share proportional to its segment, interleaved across
// trees so that every block plays every tree. Piece boundaries fall on 16-byte atoms.
std::vector<Unit> SplitIntoUnits(const Program& prog, const std::vector<int64_t>& seg_off,
                                 const std::vector<int64_t>& seg_len, int blocks, int esize, const Options& opt) {
  const int64_t align = std::max(1, 16 / esize);
  const int64_t min_piece = std::max<int64_t>(16, opt.min_piece_bytes);
  const int64_t piece_max = std::clamp<int64_t>(prog.chunk_elems() * esize, min_piece, std::max(min_piece, kMaxPieceBytes));
  std::vector<int> live;
  int64_t total_seg = 0;
  for (int t = 0; t < prog.ntrees(); ++t)
    if (seg_len[t] > 0) { live.push_back(t); total_seg += seg_len[t]; }
  std::vector<int64_t> pieces(prog.ntrees(), 0);
  if (!live.empty()) {
    const int64_t bytes = total_seg * esize;
    const int64_t m = (bytes + static_cast<int64_t>(blocks) * piece_max - 1) / (static_cast<int64_t>(blocks) * piece_max);
    int64_t U = std::min<int64_t>(m * blocks, (bytes + min_piece - 1) / min_piece);
    U = std::min<int64_t>(std::max<int64_t>(U, live.size()), kMaxUnits);
    // Largest remainders, every live tree >= 1 piece, no tree more pieces than aligned atoms.
    int64_t given = 0;
    std::vector<std::pair<double, int>> rem;
    for (int t : live) {
      const double ideal = static_cast<double>(U) * seg_len[t] / total_seg;
      const int64_t atoms = (seg_len[t] + align - 1) / align;
      pieces[t] = std::min<int64_t>(atoms, std::max<int64_t>(1, static_cast<int64_t>(ideal)));
      given += pieces[t];
      rem.push_back({ideal - static_cast<double>(pieces[t]), t});
    }
    std::sort(rem.begin(), rem.end(), [](auto& a, auto& b) { return a.first > b.first; });
    for (size_t i = 0; given < U && i < rem.size(); ++i) {
      const int t = rem[i].second;
      if (pieces[t] < (seg_len[t] + align - 1) / align) { ++pieces[t]; ++given; }
    }
  }
  std::vector<Unit> units;
  int64_t max_pieces = 0;
  for (int t : live) max_pieces = std::max(max_pieces, pieces[t]);
  for (int64_t i = 0; i < max_pieces; ++i)
    for (int t : live) {
      if (i >= pieces[t]) continue;
      const int64_t atoms = (seg_len[t] + align - 1) / align;
      const int64_t lo = std::min(seg_len[t], i * atoms / pieces[t] * align);
      const int64_t hi = std::min(seg_len[t], (i + 1) * atoms / pieces[t] * align);
      if (hi > lo) units.push_back(Unit{seg_off[t] + lo, static_cast<int32_t>(hi - lo), t});
    }
  return units;
}

// (offset, length) pairs, flattened, of [0, nv_total) outside every tree's segment: out = in there.
std::vector<int64_t> GapsOutsideSegments(const Program& prog, const std::vector<int64_t>& seg_off,
                                         const std::vector<int64_t>& seg_len, int64_t nv_total) {
  std::vector<int64_t> gaps;
  int64_t at = 0;
  for (int t : prog.trees_by_offset()) {
    if (seg_len[t] == 0) continue;  // an empty segment says nothing about coverage
    if (seg_off[t] > at) { gaps.push_back(at); gaps.push_back(seg_off[t] - at); }
    at = seg_off[t] + seg_len[t];
  }
  if (nv_total > at) { gaps.push_back(at); gaps.push_back(nv_total - at); }
  return gaps;
}

// The site block's layout, the same on every rank: first what the kernels write (counters, flags,
// pointer tables: zeroed by set-up and by reset), from `dyn` on the read-only plan.
struct SiteBlockLayout {
  size_t dyn = 0, bytes = 0;
};
std::string LayOutSiteBlock(int n, int G, int U, int ntrees, size_t gap_words, Params* base, SiteBlockLayout* out) {
  size_t off = 0;
  auto take = [&](size_t bytes, size_t al) { off = AlignUp(off, al); size_t o = off; off += bytes; return static_cast<uint32_t>(o); };
  base->off_blk_seq = take(4u * G, 16);
  base->off_ptr_flag = take(4u * 2 * n, 16);  // [peer][call parity]
  base->off_abort = take(4u * n, 16);
  base->off_ptr_in = take(8u * 2 * n, 16);
  base->off_ptr_out = take(8u * 2 * n, 16);
  base->off_inbox = take(4ull * n * 2 * std::max(U, 1), 128);
  out->dyn = AlignUp(off, 128);
  off = out->dyn;
  base->off_units = take(sizeof(Unit) * std::max(U, 1), 16);
  base->off_trees = take(sizeof(TreeRank) * std::max(ntrees, 1), 16);
  base->off_kids = take(4ull * std::max(ntrees * n, 1), 16);
  base->off_gaps = take(8ull * std::max<size_t>(gap_words, 2), 16);
  base->off_peer_base = take(8ull * n, 16);
  out->bytes = AlignUp(off, 256);
  // The kernels address the block with 32-bit offsets.
  if (out->bytes > 0xffffffffull) return "jax_blink CUDA executor: site state too large";
  return {};
}

// The host channel's part of the parameters (Mode::kHybrid): the slice and the communicator's channel.
void SetHostChannelParams(const Comm* comm, const HostSlice& host, int64_t nv_total, Params* base) {
  base->host_off = nv_total;
  base->host_elems = host.elems;
  base->host_chunk = host.chunk;
  base->host_slot = comm->host_slot;
  base->host_max_chunks = comm->host_max_chunks;
  base->hctl_blocks = comm->blocks;
  base->host_blocks = host.blocks;
  base->host_ce = host.ce ? 1 : 0;
}

// A reduce-scatter or an all-gather in n equal blocks (the layout cuda/ll_blocks.cuh takes): every
// tree with elements reduces only (reduce-scatter) or broadcasts only (all-gather), lies inside
// block `root` of the n, and the trees cover the operand. kShapeReduceScatter, kShapeAllGather or 0.
int BlockShape(const Program& prog) {
  const int n = prog.nranks();
  const int64_t total = prog.total_elems();
  if (n < 2 || total <= 0 || total % n != 0) return 0;
  const int64_t blk = total / n;
  int64_t at = 0;
  int32_t phases = 0;
  for (int t : prog.trees_by_offset()) {
    const TreeView& tv = prog.tree(t);
    if (tv.seg_len == 0) continue;
    if (phases == 0) phases = tv.phases;
    if (tv.seg_offset != at || tv.phases != phases) return 0;
    if (tv.seg_offset < tv.root * blk || tv.seg_offset + tv.seg_len > (tv.root + 1) * blk) return 0;
    at = tv.seg_offset + tv.seg_len;
  }
  if (at != total) return 0;
  return phases == kPhaseReduce ? kShapeReduceScatter : phases == kPhaseBroadcast ? kShapeAllGather : 0;
}

// A small call skips the trees: an all-reduce as LL lines up to the LL limit (any rank count up
// to kMaxLLRanks) or as chunks with one flag each up to the one-shot limit (2 ranks); a
// reduce-scatter or all-gather as LL lines of one block per peer where a block is at most the LL
// limit (cuda/ll_blocks.cuh); always where the communicator's staging holds it. Sets the
// one-shot parameters and grid; *mode stays kTree otherwise.
std::string ChooseOneShotLocked(Comm* comm, const Options& opt, const Program& prog, bool allreduce, int esize,
                                int64_t comm_id, Params* base, Mode* mode) {
  const int n = prog.nranks();
  const int G = comm->blocks;
  const int64_t payload = prog.total_elems() * esize;
  const int64_t ll_max = opt.ll_max_bytes >= 0 ? opt.ll_max_bytes : DefaultLLMax();
  const int64_t os_max = n == 2 ? (opt.oneshot_max_bytes >= 0 ? opt.oneshot_max_bytes : DefaultOneShotMax(n)) : 0;
  *mode = Mode::kTree;
  if (payload <= 0) return {};
  const int shape = allreduce ? 0 : BlockShape(prog);
  const int64_t block = payload / n;
  if (allreduce && n <= kMaxLLRanks && payload <= ll_max) *mode = Mode::kLL;
  else if (allreduce && payload <= os_max) *mode = Mode::kOneShot;
  else if (shape != 0 && n <= kMaxLLRanks && block <= ll_max) *mode = Mode::kLLBlocks;
  else return {};
  if (std::string err = EnsureStagingLocked(comm); !err.empty()) return err;
  // An inbox slot's bytes: LL lines take 16 bytes per 8 of data.
  const int64_t slot_data = *mode == Mode::kLLBlocks ? block : payload;
  const uint64_t need = *mode == Mode::kOneShot ? static_cast<uint64_t>(payload) : static_cast<uint64_t>((slot_data + 7) / 8) * 16;
  if (need > comm->region) {
    *mode = Mode::kTree;
    return {};
  }
  base->stg_off_seq = comm->off_seq;
  base->stg_off_flags = comm->off_flags;
  base->stg_off_data = comm->off_data;
  base->stg_region = comm->region;
  base->stg_max_chunks = comm->max_chunks;
  base->stg_blocks = G;
  base->os_site = static_cast<uint32_t>(comm_id) | 1u;  // never 0: k ^ site != k
  base->os_elems = prog.total_elems();
  if (*mode == Mode::kLL || *mode == Mode::kLLBlocks) {
    const int64_t lines = (slot_data + 7) / 8;
    base->grid = static_cast<int>(std::clamp<int64_t>((lines + kThreads - 1) / kThreads, 1, G));
    base->os_shape = shape;
    base->os_block_bytes = *mode == Mode::kLLBlocks ? block : 0;
    return {};
  }
  // Chunks: the program's chunk, but small enough to give every block one (>= 4 KiB, 16-byte
  // multiples); more chunks per block measured slower (benchmarks/NOTES.md, change 6).
  const int64_t spread = std::max<int64_t>(kMinOneShotChunk, AlignUp((payload + G - 1) / G, 16));
  const int64_t cbytes = std::max<int64_t>(kMinOneShotChunk, AlignUp(std::min<int64_t>(prog.chunk_elems() * esize, spread), 16));
  base->os_chunk = cbytes / esize;
  const int64_t nch = (prog.total_elems() + base->os_chunk - 1) / base->os_chunk;
  if (nch > comm->max_chunks) return "jax_blink CUDA executor: internal: one-shot chunks exceed the staging flags";
  base->grid = static_cast<int>(std::min<int64_t>(G, nch));
  return {};
}

// The two-shot all-reduce (cuda/two_shot.cuh) instead of the trees: an all-reduce site of one-hop
// stars on 3 or more ranks, of at least JAX_BLINK_TWOSHOT_MIN_BYTES per rank, whose n chunks are
// each at least one 16-byte atom. Sets the chunk, the pieces (a multiple of the grid, about kTwoShotPieceBytes
// each) and *pieces; 0 where the trees stay.
// Whether every tree with data is a one-hop star (every rank's parent is the root): the program a
// switch gets, where every pair of GPUs has the same link. Elsewhere (a DGX-1's hybrid cube-mesh)
// the trees keep to the fast links and the two-shot kernel, which writes to every peer, would not.
bool IsOneHopStars(const Program& prog) {
  for (int t = 0; t < prog.ntrees(); ++t) {
    const TreeView& tv = prog.tree(t);
    if (tv.seg_len == 0) continue;
    for (int r = 0; r < prog.nranks(); ++r)
      if (r != tv.root && tv.parent[r] != tv.root) return false;
  }
  return true;
}

int64_t ChooseTwoShot(const Program& prog, bool allreduce, int esize, int G, Params* base) {
  const int n = prog.nranks();
  const int64_t min_bytes = DefaultTwoShotMin();
  const int64_t payload = prog.total_elems() * esize;
  if (!allreduce || n < 3 || min_bytes <= 0 || payload < min_bytes || !IsOneHopStars(prog)) return 0;
  const int64_t align = std::max(1, 16 / esize);
  const int64_t chunk = prog.total_elems() / (n * align) * align;
  if (chunk <= 0) return 0;
  const int64_t per_block = chunk * esize / G;
  const int64_t piece_bytes = TwoShotPieceBytes();
  const int64_t m = std::max<int64_t>(1, (per_block + piece_bytes - 1) / piece_bytes);
  const int64_t pieces = std::min<int64_t>(m * G, kMaxUnits / 2 / G * G);
  if (pieces < G || chunk / align < pieces) return 0;  // every block at least one piece of >= 1 atom
  base->ts_chunk = chunk;
  base->ts_pieces = pieces;
  base->ts_align = align;
  base->ts_pull = TwoShotPullAlways() ? 1 : 0;
  base->ts_reducers = TwoShotReducers(G);
  base->ts_spread = TwoShotPushSpread() ? 1 : 0;
  base->os_elems = prog.total_elems();
  base->grid = G;
  return pieces;
}

// Rank r's read-only plan (the block from `dyn` on), built on the host and copied once: the units,
// how r sees each tree (parent, children with their leaf bit, push or pull per edge), the gaps
// and every rank's site block address.
std::vector<uint8_t> RankPlan(const Program& prog, int r, const Params& base, const SiteBlockLayout& layout,
                              const std::vector<Unit>& units, const std::vector<int64_t>& gaps,
                              const std::vector<int64_t>& seg_off, const std::vector<uint8_t*>& mem) {
  const int n = prog.nranks(), ntrees = prog.ntrees();
  std::vector<uint8_t> h(layout.bytes - layout.dyn, 0);
  auto at = [&](uint32_t o) { return h.data() + (o - layout.dyn); };
  if (!units.empty()) std::memcpy(at(base.off_units), units.data(), sizeof(Unit) * units.size());
  std::vector<TreeRank> trs(ntrees);
  std::vector<int32_t> kid_list;
  for (int t = 0; t < ntrees; ++t) {
    const TreeView& tv = prog.tree(t);
    TreeRank& tr = trs[t];
    tr.seg_offset = seg_off[t];
    tr.parent = tv.parent[r];
    tr.phases = tv.phases;
    tr.kid_begin = static_cast<int32_t>(kid_list.size());
    for (int c : prog.children(t, r)) kid_list.push_back(c | ((prog.children(t, c).empty() ? 1 : 0) << 16));
    tr.kid_count = static_cast<int32_t>(kid_list.size()) - tr.kid_begin;
    tr.leaf = tr.kid_count == 0;
    const bool has_reduce = (tv.phases & kPhaseReduce) != 0;
    tr.push_up = has_reduce && tr.parent >= 0 && prog.children(t, tr.parent).size() == 1;
    tr.kid_push = has_reduce && tr.kid_count == 1;
  }
  if (ntrees > 0) std::memcpy(at(base.off_trees), trs.data(), sizeof(TreeRank) * ntrees);
  if (!kid_list.empty()) std::memcpy(at(base.off_kids), kid_list.data(), 4 * kid_list.size());
  if (!gaps.empty()) std::memcpy(at(base.off_gaps), gaps.data(), 8 * gaps.size());
  std::vector<uint64_t> pb(n);
  for (int q = 0; q < n; ++q) pb[q] = reinterpret_cast<uint64_t>(mem[q]);
  std::memcpy(at(base.off_peer_base), pb.data(), 8 * n);
  return h;
}

void FreeSiteBlocks(const std::vector<int>& devices, std::vector<uint8_t*>* mem) {
  for (size_t r = 0; r < mem->size(); ++r)
    if ((*mem)[r] != nullptr && cudaSetDevice(devices[r]) == cudaSuccess) {
      cudaFree((*mem)[r]);  // a failing set-up's clean-up: its first error is the one reported
      (*mem)[r] = nullptr;
    }
}

// One site block per rank on its device: zeroed where the kernels write, the plan behind it.
// Every rank's address goes into every plan, so all blocks exist before any plan is built.
std::string MakeSiteBlocks(const std::vector<int>& devices, const Program& prog, const Params& base,
                           const SiteBlockLayout& layout, const std::vector<Unit>& units, const std::vector<int64_t>& gaps,
                           const std::vector<int64_t>& seg_off, std::vector<uint8_t*>* mem) {
  const int n = static_cast<int>(devices.size());
  mem->assign(n, nullptr);
  // RankPlan copies the units into the layout's room for base.nunits of them.
  if (units.size() > static_cast<size_t>(std::max(base.nunits, 1)))
    return "jax_blink CUDA executor: internal error: " + std::to_string(units.size()) + " units for room of " +
           std::to_string(base.nunits);
  for (int r = 0; r < n; ++r) {
    cudaError_t e = cudaSetDevice(devices[r]);
    if (e == cudaSuccess) e = cudaMalloc(&(*mem)[r], layout.bytes);
    if (e != cudaSuccess) { FreeSiteBlocks(devices, mem); return CudaErr("cudaMalloc (site state)", e); }
  }
  for (int r = 0; r < n; ++r) {
    const std::vector<uint8_t> plan = RankPlan(prog, r, base, layout, units, gaps, seg_off, *mem);
    DeviceState* ds = g_dev[devices[r]].load();
    cudaError_t e = cudaSetDevice(devices[r]);
    if (e == cudaSuccess) e = cudaMemsetAsync((*mem)[r], 0, layout.dyn, ds->stream);
    if (e == cudaSuccess)
      e = cudaMemcpyAsync((*mem)[r] + layout.dyn, plan.data(), plan.size(), cudaMemcpyHostToDevice, ds->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(ds->stream);  // `plan` dies at the end of this pass
    if (e != cudaSuccess) { FreeSiteBlocks(devices, mem); return CudaErr("initialising site state", e); }
  }
  return {};
}

// Rank r's Site: the parameters every rank shares, plus its own site block, its device's error
// records and kernel handles, and its side of the communicator's staging or host channel.
std::unique_ptr<Site> NewRankSite(Comm* comm, const Program& prog, int r, int device, int esize, Mode mode, bool host_ce,
                                  const Params& base, const SiteBlockLayout& layout, uint8_t* mem) {
  auto s = std::make_unique<Site>();
  const DeviceState* ds = g_dev[device].load();
  s->comm = comm;
  s->rank = r;
  s->nranks = prog.nranks();
  s->device = device;
  s->esize = esize;
  s->grid = base.grid;
  s->total = prog.total_elems();
  s->units = base.nunits;
  s->mem = mem;
  s->mem_bytes = layout.bytes;
  s->dyn_bytes = layout.dyn;
  s->params = base;
  s->params.site = mem;
  s->params.rank = r;
  s->params.device = device;
  s->params.dev_claim = ds->claim;
  s->params.rec = ds->rec_dev;
  s->mode = mode;
  std::memcpy(s->fn, ds->fn[KernelIndex(mode)], sizeof s->fn);
  s->one_rank = ds->one_rank;
  if (prog.nranks() == 1) {  // one_rank_kernel's block: as many threads as a small copy has 16-byte words
    const int64_t words = (prog.total_elems() * esize + 15) / 16;
    s->copy_threads = static_cast<unsigned>(base.grid > 1 ? kCopyThreads : std::clamp<int64_t>((words + 31) / 32 * 32, 32, kCopyThreads));
  }
  if (mode == Mode::kLL || mode == Mode::kOneShot || mode == Mode::kLLBlocks) s->params.stg = comm->stg[r];
  if (mode == Mode::kHybrid) {
    s->params.host_mine = static_cast<uint8_t*>(comm->host_dev[r]);
    s->params.host_peer = static_cast<const uint8_t*>(comm->host_dev[1 - r]);
    s->params.hctl_mine = comm->hctl[r];
    s->params.hctl_peer = comm->hctl[1 - r];
    s->host_ce = host_ce;
    if (host_ce) {
      s->params.stage = comm->ce[r]->stage;
      s->params.ready_mine = comm->ce[r]->ready_dev;
    }
  }
  return s;
}

// A site for every rank of `devices` at once, under g_mu: check the request, find the
// communicator, decide what the host channel takes, cut the trees' segments into units, lay out
// the site block, choose the kernel, then make and fill one block per rank.
std::string CreateSiteLocked(const std::vector<int>& devices, const int32_t* program, int64_t len, int esize,
                             const Options& opt, int64_t comm_id, std::vector<Site*>* sites) {
  if (std::string env = CheckEnvironment(); !env.empty()) return env;
  Program prog;
  if (std::string err = prog.Decode(program, len); !err.empty()) return "jax_blink CUDA executor: bad schedule program: " + err;
  if (std::string err = CheckSiteRequest(prog, devices, esize); !err.empty()) return err;
  Comm* comm;
  if (std::string err = GetCommLocked(devices, opt, &comm); !err.empty()) return err;
  DeviceGuard guard;
  const int n = prog.nranks();
  const int G = comm->blocks;
  const int64_t align = std::max(1, 16 / esize);  // elements per 16 bytes: the vector paths' unit
  const bool allreduce = IsAllReduce(prog);

  HostSlice host;
  if (std::string err = FitHostSliceLocked(comm, opt, prog, allreduce, esize, &host); !err.empty()) return err;
  const int64_t nv_total = prog.total_elems() - host.elems;  // what the trees (NVLink) carry
  std::vector<int64_t> seg_off, seg_len;
  SegmentsBeforeHostSlice(prog, nv_total, align, &seg_off, &seg_len);
  const int Gu = G - host.blocks;  // blocks that play the trees' units
  Params base{};
  // The two-shot kernel keeps no units: its flags take the units' place, 2 per piece, so its site
  // cuts none (their room in the layout is the flags', fewer than the trees' units on a small grid).
  const int64_t ts_pieces = host.elems > 0 ? 0 : ChooseTwoShot(prog, allreduce, esize, G, &base);
  const std::vector<Unit> units =
      ts_pieces > 0 ? std::vector<Unit>{} : SplitIntoUnits(prog, seg_off, seg_len, Gu, esize, opt);
  const int U = static_cast<int>(units.size());
  const std::vector<int64_t> gaps = GapsOutsideSegments(prog, seg_off, seg_len, nv_total);

  SiteBlockLayout layout;
  if (std::string err = LayOutSiteBlock(n, G, ts_pieces > 0 ? static_cast<int>(2 * ts_pieces) : U, prog.ntrees(),
                                        gaps.size(), &base, &layout);
      !err.empty())
    return err;
  base.nranks = n;
  base.nunits = ts_pieces > 0 ? static_cast<int32_t>(2 * ts_pieces) : U;
  base.ngaps = static_cast<int32_t>(gaps.size() / 2);
  base.chunk_elems = prog.chunk_elems();
  base.comm_id = comm_id;
  base.grid = ts_pieces > 0 ? G : std::max(1, std::min(Gu, U));
  if (n == 1)  // the identity: one_rank_kernel's blocks (Launch)
    base.grid = static_cast<int>(std::clamp<int64_t>(
        (prog.total_elems() * esize + kCopyBytesPerBlock - 1) / kCopyBytesPerBlock, 1, int64_t{8} * G));
  // The host channel beside the trees, or else perhaps a one-shot kernel instead of them.
  Mode mode = host.elems > 0 ? Mode::kHybrid : Mode::kTree;
  if (ts_pieces > 0) {
    mode = Mode::kTwoShot;
  } else if (mode == Mode::kHybrid) {
    SetHostChannelParams(comm, host, nv_total, &base);
  } else if (std::string err = ChooseOneShotLocked(comm, opt, prog, allreduce, esize, comm_id, &base, &mode);
             !err.empty()) {
    return err;
  }

  std::vector<uint8_t*> mem;
  if (std::string err = MakeSiteBlocks(devices, prog, base, layout, units, gaps, seg_off, &mem); !err.empty()) return err;
  sites->assign(n, nullptr);
  for (int r = 0; r < n; ++r) {
    std::unique_ptr<Site> s = NewRankSite(comm, prog, r, devices[r], esize, mode, host.ce, base, layout, mem[r]);
    s->twoshot_ce = mode == Mode::kTwoShot && TwoShotOnCopyEngines();
    s->words.assign(program, program + len);
    (*sites)[r] = s.get();
    comm->sites.push_back(s.get());
    g_sites.push_back(std::move(s));
  }
  return {};
}

std::string Describe(const ErrorRecord& r) {
  static const char* kAt[] = {"waiting for its buffer pointers", "reduce", "broadcast",
                              "exit: waiting for it to finish reading this rank's buffers",
                              "one-shot: waiting for its data in the inbox",
                              "host channel: waiting for its chunk in pinned host memory"};
  const char* at = (r.phase >= 0 && r.phase < 6) ? kAt[r.phase] : "?";
  std::string where = (r.phase == kAtOneShot || r.phase == kAtHost)
                          ? std::string(at) + " (element " + std::to_string(r.elem_offset) + ")"
                          : "tree " + std::to_string(r.tree) + ", chunk " + std::to_string(r.chunk) + " (element " +
                                std::to_string(r.elem_offset) + ", " + at + ")";
  std::string who = "jax_blink CUDA executor: GPU " + std::to_string(r.device) + ", rank " + std::to_string(r.rank) +
                    " of " + std::to_string(r.nranks) + ", collective " + std::to_string(r.comm_id) +
                    ", call #" + std::to_string(r.seq) + ": ";
  std::string what;
  const std::string flag_at = r.phase == kAtHost ? "host-channel call #" : "call #";  // the communicator's hybrid calls
  if (r.kind == kErrTimeout)
    what = "timed out after " + std::to_string(r.timeout_ms) + " ms waiting for rank " + std::to_string(r.peer) +
           " in " + where + "; its flag is at " + flag_at + std::to_string(r.observed) +
           ". A rank did not join this collective (skipped under lax.cond?) or a peer is stuck.";
  else if (r.kind == kErrAhead)
    what = "rank " + std::to_string(r.peer) + " is already at " + flag_at + std::to_string(r.observed) +
           " in " + where + ": the ranks ran different numbers of calls of this collective.";
  else if (r.kind == kErrAborted)
    what = "rank " + std::to_string(r.peer) + " gave up (at its call #" + std::to_string(r.observed) +
           ") while this rank waited for it in " + where + "; see the error of rank " + std::to_string(r.peer) + "'s GPU.";
  else if (r.kind == kErrMismatch)
    what = "rank " + std::to_string(r.peer) + " ran another collective at this call (" + where +
           "): the ranks ran this communicator's collectives in different orders.";
  else
    what = "failed (kind " + std::to_string(r.kind) + ") in " + where + ".";
  return who + what + " Every collective on this GPU now fails until jax_blink._blink_cuda.reset() (call it when nothing runs).";
}

}  // namespace

int DTypeSize(DType d) {
  switch (d) {
    case DType::kF32: case DType::kS32: return 4;
    case DType::kF64: case DType::kS64: return 8;
    case DType::kBF16: case DType::kF16: return 2;
  }
  return 0;
}

const char* DTypeName(DType d) {
  switch (d) {
    case DType::kF32: return "float32";
    case DType::kF64: return "float64";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kS32: return "int32";
    case DType::kS64: return "int64";
  }
  return "?";
}

std::string CreateSite(const std::vector<int>& devices, const int32_t* program, int64_t len, int esize,
                       const Options& opt, int64_t comm_id, std::vector<Site*>* sites) {
  std::lock_guard<std::mutex> g(g_mu);
  return CreateSiteLocked(devices, program, len, esize, opt, comm_id, sites);
}

Site* FindSite(int64_t comm_id, int device) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_site_by_dev.find({comm_id, device});
  return it == g_site_by_dev.end() ? nullptr : it->second;
}

std::string JoinSite(int64_t comm_id, int32_t group, int rank, int device, const int32_t* program,
                     int64_t len, int esize, int64_t timeout_ms, const Options& opt, Site** site) {
  auto who = [&] {
    return "jax_blink CUDA executor: rank " + std::to_string(rank) + " (GPU " + std::to_string(device) +
           ", group " + std::to_string(group) + ") of collective " + std::to_string(comm_id) + ": ";
  };
  if (len < kHeaderLen) return who() + "bad schedule program (shorter than its header)";
  const int n = program[1];
  if (n < 1 || n > kMaxRanks) return who() + "bad rank count " + std::to_string(n) + " in the program";
  if (rank < 0 || rank >= n) return who() + "rank is outside the program's " + std::to_string(n) + " ranks";
  std::unique_lock<std::mutex> lk(g_mu);
  auto& slot = g_pending[{comm_id, group}];
  if (!slot) {
    slot = std::make_shared<Pending>();
    slot->words.assign(program, program + len);
    slot->nranks = n;
    slot->devices.assign(n, -1);
  }
  std::shared_ptr<Pending> pd = slot;
  if (pd->done) {
    if (!pd->error.empty()) return pd->error;
    if (pd->devices[rank] != device)
      return who() + "rank already taken by GPU " + std::to_string(pd->devices[rank]);
    *site = pd->sites[rank];
    return {};
  }
  if (pd->words.size() != static_cast<size_t>(len) || !std::equal(program, program + len, pd->words.begin()))
    return who() + "its schedule program differs from its peers' (every rank must run the same call)";
  if (pd->devices[rank] != -1)
    return who() + "rank already joined from GPU " + std::to_string(pd->devices[rank]);
  pd->devices[rank] = device;
  ++pd->joined;
  if (pd->joined == pd->nranks) {
    std::vector<Site*> sites;
    pd->error = CreateSiteLocked(pd->devices, pd->words.data(), static_cast<int64_t>(pd->words.size()), esize,
                                 opt, comm_id, &sites);
    if (pd->error.empty()) {
      pd->sites = sites;
      for (int r = 0; r < n; ++r) g_site_by_dev[{comm_id, pd->devices[r]}] = sites[r];
    } else {
      pd->error = who() + pd->error;
    }
    pd->done = true;
    pd->cv.notify_all();
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 1));
    if (!pd->cv.wait_until(lk, deadline, [&] { return pd->done; })) {
      std::string missing;
      int nmissing = 0;
      for (int r = 0; r < n; ++r)
        if (pd->devices[r] < 0) missing += (nmissing++ ? ", " : "") + std::to_string(r);
      pd->devices[rank] = -1;  // leave, so that a later attempt can join again
      --pd->joined;
      // A rank that timed out before this one left too, so it is listed with the one it missed.
      return who() + "waited " + std::to_string(timeout_ms) + " ms at set-up for " + (nmissing == 1 ? "rank " : "ranks ") +
             missing + " to join (a rank did not run this collective, or timed out waiting itself?)";
    }
  }
  if (!pd->error.empty()) return pd->error;
  *site = pd->sites[rank];
  return {};
}

int SiteRank(const Site* s) { return s->rank; }
int SiteRanks(const Site* s) { return s->nranks; }
int SiteEsize(const Site* s) { return s->esize; }
bool SiteTwoShotOnCopyEngines(const Site* s) { return s->twoshot_ce; }
int64_t SiteTotalElems(const Site* s) { return s->total; }
int64_t SiteUnits(const Site* s) { return s->units; }
int SiteGrid(const Site* s) { return s->grid; }
Mode SiteMode(const Site* s) { return s->mode; }
int64_t SiteHostElems(const Site* s) { return s->params.host_elems; }
int SiteHostBlocks(const Site* s) { return s->params.host_blocks; }
bool SiteHostCopyEngines(const Site* s) { return s->host_ce; }

const char* ModeName(Mode m) {
  switch (m) {
    case Mode::kTree: return "tree";
    case Mode::kLL: return "ll";
    case Mode::kOneShot: return "oneshot";
    case Mode::kHybrid: return "hybrid";
    case Mode::kTwoShot: return "twoshot";
    case Mode::kLLBlocks: return "ll-blocks";
  }
  return "?";
}

bool SiteProgramMatches(Site* s, const int32_t* program, int64_t len) {
  if (static_cast<size_t>(len) != s->words.size()) return false;
  if (s->last_ptr.load(std::memory_order_relaxed) == program) return true;
  if (!std::equal(program, program + len, s->words.begin())) return false;
  s->last_ptr.store(program, std::memory_order_relaxed);
  return true;
}

// A hybrid call whose host channel runs on copy engines (Params::host_ce): fork two side streams
// from the call's stream, launch the kernel, enqueue per chunk c
//   to_host:   copy in[c] -> own outbox (slot kh & 1); write kh into the peer's ready[c] (pinned)
//   from_host: wait until own ready[c] >= kh; copy the peer's outbox[c] -> stage[c]; write kh into
//              own landed[c] (the kernel's host blocks wait for it, then reduce)
// then join both to the call's stream. kh counts the communicator's hybrid calls on this rank
// (host side: a captured call would replay stale numbers, so capture is refused). With in == out
// the kernel overwrites in[c]: then from_host also waits for own sent[c] (to_host's copy done).
// Why two outbox slots suffice: as for the SM channel (host_channel). No wait without a bound:
// ready[c] is written by the peer's copy or, when this rank's kernel gives up, by its host blocks.
std::string LaunchWithCopyEngines(Site* s, KernelFn fn, Params& p, cudaStream_t stream) {
  Comm* c = s->comm;
  Comm::CopyEngines& x = *c->ce[s->rank];
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  JB_TRY("cudaStreamIsCapturing", cudaStreamIsCapturing(stream, &cs));
  if (cs != cudaStreamCaptureStatusNone)
    return "jax_blink CUDA executor: a hybrid all-reduce whose host channel runs on copy engines cannot be captured "
           "(CUDA graph / command buffer): set JAX_BLINK_HOST_ENGINE=sm (its SM-driven channel replays)";
  Comm::CopyEngines& peer = *c->ce[1 - s->rank];
  std::lock_guard<std::mutex> lock(x.mu);
  const uint32_t kh = ++x.calls;
  const int par = static_cast<int>(kh & 1u);
  p.host_kh = kh;
  const size_t es = static_cast<size_t>(s->esize);
  const int64_t C = p.host_chunk, total = p.host_elems;
  const int64_t nch = (total + C - 1) / C;
  const bool alias = p.in == p.out;
  const uint8_t* in = static_cast<const uint8_t*>(p.in) + p.host_off * es;
  uint8_t* mine = static_cast<uint8_t*>(c->host_buf[s->rank]) + par * c->host_slot;
  const uint8_t* theirs = static_cast<const uint8_t*>(c->host_buf[1 - s->rank]) + par * c->host_slot;
  const int64_t flag_at = static_cast<int64_t>(par) * c->host_max_chunks;
  uint32_t* landed = c->hctl[s->rank] + c->blocks + flag_at;  // the control block's layout: EnsureHostChannelLocked
  uint32_t* sent = landed + 2 * c->host_max_chunks;
  auto dptr = [](const void* q) { return reinterpret_cast<CUdeviceptr>(q); };
  auto cu = [](CUresult r, const char* what) -> std::string {
    return r == CUDA_SUCCESS ? std::string() : std::string("jax_blink CUDA executor: ") + what + " failed (CUresult " + std::to_string(r) + ")";
  };
  JB_TRY("cudaEventRecord (fork)", cudaEventRecord(x.fork, stream));
  JB_TRY("cudaStreamWaitEvent (fork)", cudaStreamWaitEvent(x.to_host, x.fork, 0));
  JB_TRY("cudaStreamWaitEvent (fork)", cudaStreamWaitEvent(x.from_host, x.fork, 0));
  void* args[] = {&p};
  JB_TRY("launching the collective kernel",
         cudaLaunchKernel(reinterpret_cast<const void*>(fn), dim3(s->grid + p.host_blocks), dim3(kThreads), args, 0, stream));
  for (int64_t k = 0; k < nch; ++k) {
    const size_t lo = static_cast<size_t>(k * C) * es, len = static_cast<size_t>(std::min(C, total - k * C)) * es;
    JB_TRY("cudaMemcpyAsync (to host)", cudaMemcpyAsync(mine + lo, in + lo, len, cudaMemcpyDeviceToHost, x.to_host));
    std::string e = cu(g_write_value(x.to_host, dptr(peer.ready_dev + flag_at + k), kh, 0), "cuStreamWriteValue32 (ready)");
    if (e.empty() && alias) e = cu(g_write_value(x.to_host, dptr(sent + k), kh, 0), "cuStreamWriteValue32 (sent)");
    if (e.empty()) e = cu(g_wait_value(x.from_host, dptr(x.ready_dev + flag_at + k), kh, CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32 (ready)");
    if (e.empty() && alias) e = cu(g_wait_value(x.from_host, dptr(sent + k), kh, CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32 (sent)");
    if (!e.empty()) return e;
    JB_TRY("cudaMemcpyAsync (from host)", cudaMemcpyAsync(x.stage + lo, theirs + lo, len, cudaMemcpyHostToDevice, x.from_host));
    e = cu(g_write_value(x.from_host, dptr(landed + k), kh, 0), "cuStreamWriteValue32 (landed)");
    if (!e.empty()) return e;
  }
  JB_TRY("cudaEventRecord (join)", cudaEventRecord(x.joined_to, x.to_host));
  JB_TRY("cudaEventRecord (join)", cudaEventRecord(x.joined_from, x.from_host));
  JB_TRY("cudaStreamWaitEvent (join)", cudaStreamWaitEvent(stream, x.joined_to, 0));
  JB_TRY("cudaStreamWaitEvent (join)", cudaStreamWaitEvent(stream, x.joined_from, 0));
  return {};
}

namespace {

template <class E>
void LaunchReduceTermsOf(int op, int blocks, cudaStream_t stream, const ReduceTermsArgs& a) {
  if (op == 0) reduce_terms_kernel<E, OpSum><<<blocks, kThreads, 0, stream>>>(a);
  else if (op == 1) reduce_terms_kernel<E, OpMax><<<blocks, kThreads, 0, stream>>>(a);
  else reduce_terms_kernel<E, OpMin><<<blocks, kThreads, 0, stream>>>(a);
}

}  // namespace

std::string LaunchReduceTerms(DType dtype, int32_t op, void* out, const void* const* srcs, int nsrc, int64_t elems,
                              int blocks, cudaStream_t stream) {
  if (nsrc < 1 || nsrc > kMaxRanks || op < 0 || op >= kNumOps || blocks < 1) return "bad reduce-terms arguments";
  if (elems <= 0) return {};
  ReduceTermsArgs a{};
  a.out = out;
  for (int k = 0; k < nsrc; ++k) a.src[k] = srcs[k];
  a.nsrc = nsrc;
  a.elems = elems;
  switch (dtype) {
    case DType::kF32: LaunchReduceTermsOf<EF32>(op, blocks, stream, a); break;
    case DType::kF64: LaunchReduceTermsOf<EF64>(op, blocks, stream, a); break;
    case DType::kBF16: LaunchReduceTermsOf<EBF16>(op, blocks, stream, a); break;
    case DType::kF16: LaunchReduceTermsOf<EF16>(op, blocks, stream, a); break;
    case DType::kS32: LaunchReduceTermsOf<ES32>(op, blocks, stream, a); break;
    case DType::kS64: LaunchReduceTermsOf<ES64>(op, blocks, stream, a); break;
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : std::string("launching the reduction: ") + cudaGetErrorString(e);
}

// JAX_BLINK_LOG_BUFFERS=1 (debugging): one stderr line per launch with this rank's operand and
// result and the CUDA allocation each lies in, so that a sanitizer's faulting address can be
// placed against every rank's buffers of every call (issue 31's 3-GPU memcheck finding).
using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
void LogBuffers(Site* s, const void* in, const void* out) {
  static MemGetAddressRangeFn range = [] {
    void* f = nullptr;
    return DriverEntry("cuMemGetAddressRange", &f).empty() ? reinterpret_cast<MemGetAddressRangeFn>(f) : nullptr;
  }();
  ++s->launches;
  auto where = [&](const void* ptr) {
    CUdeviceptr base = 0;
    size_t size = 0;
    if (range == nullptr || range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS)
      return std::string("(allocation unknown)");
    char b[96];
    std::snprintf(b, sizeof b, "(in [0x%llx, +%zu))", static_cast<unsigned long long>(base), size);
    return std::string(b);
  };
  std::fprintf(stderr, "jax_blink buffers: device %d rank %d/%d mode %s launch %llu: in %p %s out %p %s, %lld bytes\n",
               s->device, s->rank, s->nranks, ModeName(s->mode), static_cast<unsigned long long>(s->launches), in,
               where(in).c_str(), out, where(out).c_str(), static_cast<long long>(s->total * s->esize));
}

std::string Launch(Site* s, DType dtype, int32_t op, const void* in, void* out, cudaStream_t stream,
                   int64_t timeout_ms) {
  if (op < 0 || op >= kNumOps) return "jax_blink CUDA executor: op " + std::to_string(op) + " is not supported";
  const int dt = static_cast<int>(dtype);
  if (dt < 0 || dt >= kNumDTypes) return "jax_blink CUDA executor: unsupported dtype";
  if (s->nranks == 1 && in == out) return {};  // the identity, nothing to copy
  static const bool log_buffers = EnvIs("JAX_BLINK_LOG_BUFFERS", "1");
  if (log_buffers) LogBuffers(s, in, out);
  // The site's device must be current: its kernel handle belongs to that device's primary context.
  // XLA calls the handler with it current (one cheap check); the self-test's threads switch here.
  int cur = -1;
  cudaGetDevice(&cur);
  if (cur != s->device) cudaSetDevice(s->device);
  // The driver's launch with the handle fetched at set-up: the runtime's cudaLaunchKernel would
  // look up the current device and the function on every call.
  const LaunchKernelFn launch = g_launch_kernel.load(std::memory_order_relaxed);
  CUresult r;
  if (s->nranks == 1) {  // the identity: a copy
    const uint8_t* src = static_cast<const uint8_t*>(in);
    uint8_t* dst = static_cast<uint8_t*>(out);
    int64_t bytes = s->total * s->esize;
    void* args[] = {&src, &dst, &bytes};
    r = launch(s->one_rank, static_cast<unsigned>(s->grid), 1, 1, s->copy_threads, 1, 1, 0, stream, args, nullptr);
  } else {
    Params p = s->params;
    p.in = in;
    p.out = out;
    if (timeout_ms <= 0) timeout_ms = 10000;
    p.timeout_ms = timeout_ms;
    p.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000ull;
    if (s->host_ce) return LaunchWithCopyEngines(s, KernelFor(dtype, op, s->mode), p, stream);
    void* args[] = {&p};
    r = launch(s->fn[dt][op], static_cast<unsigned>(s->grid + p.host_blocks), 1, 1, kThreads, 1, 1, 0, stream, args,
               nullptr);
  }
  if (r != CUDA_SUCCESS)
    return "jax_blink CUDA executor: launching the collective kernel failed (CUresult " + std::to_string(r) + ")";
  return {};
}

std::string DeviceError(int device) {
  if (device < 0 || device >= kMaxDevices) return {};
  DeviceState* ds = g_dev[device].load(std::memory_order_acquire);
  if (ds == nullptr || ds->rec->ready == 0) return {};
  std::atomic_thread_fence(std::memory_order_acquire);
  ErrorRecord copy;
  std::memcpy(&copy, const_cast<const ErrorRecord*>(ds->rec), sizeof copy);
  return Describe(copy);
}

std::string CheckAll() {
  std::string all;
  for (int d = 0; d < kMaxDevices; ++d) {
    std::string e = DeviceError(d);
    if (!e.empty()) all += (all.empty() ? "" : "\n") + e;
  }
  return all;
}

std::string ResetAll() {
  std::lock_guard<std::mutex> g(g_mu);
  DeviceGuard guard;
  for (int d = 0; d < kMaxDevices; ++d)
    if (g_dev[d].load()) {
      JB_TRY("cudaSetDevice", cudaSetDevice(d));
      JB_TRY("cudaDeviceSynchronize (reset)", cudaDeviceSynchronize());
    }
  for (auto& s : g_sites) {
    DeviceState* ds = g_dev[s->device].load();
    JB_TRY("cudaSetDevice", cudaSetDevice(s->device));
    JB_TRY("cudaMemsetAsync (reset)", cudaMemsetAsync(s->mem, 0, s->dyn_bytes, ds->stream));
  }
  for (auto& [key, c] : g_comms)
    for (size_t r = 0; r < c->stg.size(); ++r)
      if (c->stg[r] != nullptr) {
        DeviceState* ds = g_dev[c->devices[r]].load();
        JB_TRY("cudaSetDevice", cudaSetDevice(c->devices[r]));
        JB_TRY("cudaMemsetAsync (reset staging)",
               cudaMemsetAsync(c->stg[r] + c->stg_dyn, 0, c->stg_bytes - c->stg_dyn, ds->stream));
      }
  for (auto& [key, c] : g_comms) {
    for (size_t r = 0; r < c->hctl.size(); ++r) {
      DeviceState* ds = g_dev[c->devices[r]].load();
      JB_TRY("cudaSetDevice", cudaSetDevice(c->devices[r]));
      JB_TRY("cudaMemsetAsync (reset host channel)", cudaMemsetAsync(c->hctl[r], 0, c->hctl_bytes, ds->stream));
    }
    for (auto& x : c->ce) {  // the device was synchronised above: no copy is in flight
      std::memset(x->ready_host, 0, 8ull * c->host_max_chunks);
      x->calls = 0;
    }
  }
  for (int d = 0; d < kMaxDevices; ++d)
    if (DeviceState* ds = g_dev[d].load()) {
      JB_TRY("cudaSetDevice", cudaSetDevice(d));
      JB_TRY("cudaMemsetAsync (reset)", cudaMemsetAsync(ds->claim, 0, 256, ds->stream));
      JB_TRY("cudaStreamSynchronize (reset)", cudaStreamSynchronize(ds->stream));
      std::memset(const_cast<ErrorRecord*>(ds->rec), 0, sizeof(ErrorRecord));
    }
  return {};
}

void ReleaseAll() {
  std::lock_guard<std::mutex> g(g_mu);
  DeviceGuard guard;
  for (int d = 0; d < kMaxDevices; ++d)
    if (g_dev[d].load()) { cudaSetDevice(d); cudaDeviceSynchronize(); }
  for (auto& s : g_sites) { cudaSetDevice(s->device); cudaFree(s->mem); }
  for (auto& [key, c] : g_comms) {
    for (size_t r = 0; r < c->stg.size(); ++r)
      if (c->stg[r] != nullptr) { cudaSetDevice(c->devices[r]); cudaFree(c->stg[r]); }
    FreeHostChannel(c.get());
    FreeCopyEngines(c.get());
  }
  g_sites.clear();
  g_site_by_dev.clear();
  g_pending.clear();
  g_comms.clear();
  for (int d = 0; d < kMaxDevices; ++d)
    if (DeviceState* ds = g_dev[d].exchange(nullptr)) {
      cudaSetDevice(d);
      cudaFree(ds->claim);
      cudaStreamDestroy(ds->stream);
      cudaFreeHost(ds->rec);
      delete ds;
    }
}

std::vector<CommInfo> Comms() {
  std::lock_guard<std::mutex> g(g_mu);
  std::vector<CommInfo> out;
  for (auto& [key, c] : g_comms) {
    CommInfo info;
    info.devices = c->devices;
    info.blocks = c->blocks;
    info.num_sites = static_cast<int>(c->sites.size());
    std::map<int, int64_t> per_dev;
    for (Site* s : c->sites) {
      per_dev[s->device] += static_cast<int64_t>(s->mem_bytes);
      ++info.sites_by_mode[static_cast<int>(s->mode)];
    }
    for (auto& [d, b] : per_dev) info.control_bytes = std::max(info.control_bytes, b);
    info.host_bytes = c->host_made ? static_cast<int64_t>(2 * c->host_slot) : 0;
    if (c->host_made) info.control_bytes += static_cast<int64_t>(c->hctl_bytes);
    info.staging_bytes = static_cast<int64_t>(c->stg_bytes + (c->ce_made ? c->stage_bytes : 0));
    out.push_back(info);
  }
  return out;
}

bool ParseByteCount(const char* text, int64_t* out) {
  if (text == nullptr || *text < '0' || *text > '9') return false;  // no sign, no blank
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 10);
  int shift = 0;
  if (*end != 0) {
    switch (*end) {
      case 'K': case 'k': shift = 10; break;
      case 'M': case 'm': shift = 20; break;
      case 'G': case 'g': shift = 30; break;
      default: return false;
    }
    if (end[1] != 0) return false;
  }
  if (errno != 0 || v > (static_cast<unsigned long long>(INT64_MAX) >> shift)) return false;
  *out = static_cast<int64_t>(v << shift);
  return true;
}

std::string CheckEnvironment() {
  std::string err;
  auto bad = [&](const char* name, const char* takes) {
    if (err.empty())
      err = std::string("jax_blink CUDA executor: ") + name + "='" + EnvValue(name) + "' is not understood: it takes " +
            takes + "; fix or unset it (unset: the default)";
  };
  int64_t v = 0;
  for (const char* name : {"JAX_BLINK_LL_BYTES", "JAX_BLINK_ONESHOT_BYTES", "JAX_BLINK_HOST_MIN_BYTES",
                           "JAX_BLINK_HOST_MAX_BYTES", "JAX_BLINK_HOST_CHUNK_BYTES", "JAX_BLINK_TWOSHOT_MIN_BYTES",
                           "JAX_BLINK_TWOSHOT_PIECE_BYTES"})
    if (EnvValue(name) != nullptr && !ParseByteCount(EnvValue(name), &v))
      bad(name, "a byte count such as 8388608, 512K, 16M or 1G");
  for (const char* name : {"JAX_BLINK_CUDA_BLOCKS", "JAX_BLINK_HOST_BLOCKS", "JAX_BLINK_TWOSHOT_REDUCERS"})
    if (EnvValue(name) != nullptr && !EnvCount(name, 0, kMaxCudaBlocks, &v))
      bad(name, "an integer from 0 to 65536");
  double share = 0;
  if (EnvValue("JAX_BLINK_HOST_SHARE") != nullptr && !EnvShare(&share))
    bad("JAX_BLINK_HOST_SHARE", "a fraction from 0 to 1 (0: no host channel)");
  auto one_of = [&](const char* name, const char* a, const char* b, const char* takes) {
    if (EnvValue(name) != nullptr && !EnvIs(name, a) && !EnvIs(name, b)) bad(name, takes);
  };
  one_of("JAX_BLINK_HOST_ENGINE", "sm", "ce", "sm (the kernel's SMs) or ce (copy engines)");
  one_of("JAX_BLINK_TWOSHOT_ENGINE", "sm", "ce",
         "sm (the two-shot kernel) or ce (copy engines move the bytes, a kernel adds them up)");
  one_of("JAX_BLINK_TWOSHOT_MODE", "auto", "pull",
         "auto (remote writes unless an operand aliases its result) or pull (remote reads)");
  one_of("JAX_BLINK_LOG_BUFFERS", "0", "1", "1 (a stderr line per launch: its buffers) or 0");
  one_of("JAX_BLINK_TWOSHOT_PUSH", "serial", "spread",
         "serial (each peer's whole piece in turn) or spread (the peers in turn every 32 KiB per block)");
  return err;
}

std::string KernelImageProblem(int device) {
  DeviceGuard guard;
  JB_TRY("cudaSetDevice", cudaSetDevice(device));
  // Loads the module on this device (lazily loaded modules load here): the fatbinary's cubins
  // and PTX are matched against the device's architecture now, not deep inside a call.
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(&attr, &one_rank_kernel);
  if (e == cudaSuccess) return {};
  cudaGetLastError();  // not sticky, but leave no error behind for the caller's next call
  return CudaErr("loading the kernels (cudaFuncGetAttributes)", e);
}

const char* Version() {
  return "jax_blink CUDA executor 0.4.5 (program format v1; one-shot all-reduce through a staging inbox "
         "(LL lines / flagged chunks) up to a size limit, and LL reduce-scatter and all-gather of small blocks; "
         "two-shot all-reduce on 3+ GPUs from 16 MiB; trees elsewhere: push where the tree allows, "
         "in-place reads elsewhere; large 2-GPU all-reduces send a share through pinned host memory beside NVLink; "
         "one rank: a copy; launched through the driver with handles fetched at set-up)";
}

}  // namespace jax_blink::cuda
