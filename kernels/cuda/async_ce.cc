// The copy-engine form of the asynchronous all-reduce (JAX_BLINK_ASYNC_ENGINE=ce; docs/overlap.md).
//
// Why: the executor's kernels move every byte with SM loads and stores, and beside the backward
// pass they take SMs and memory bandwidth from it (the overlapped step was slower than the
// synchronous one). Here the copy engines move the bytes and a few blocks only add them up.
//
// One call, rank r of n, chunk s = elements [s c, (s + 1) c) (c a whole number of 16-byte atoms):
//   1. record `ready` on the side stream (x is written); meet the peers (phase 0);
//   2. copy every peer's chunk r into this device's scratch (each copy after the peer's `ready`);
//   3. reduce chunk r in rank order into out (this rank's term from x);
//   4. record `reduced`; meet (phase 1);
//   5. copy every peer's chunk s of its out into this out (after the peer's `reduced`);
//   6. record `finished`; meet (phase 2); wait for every peer's `finished`: no peer reads this
//      rank's x or out any more once the side stream passes here.
// Why the events are the right ones: a rank records call k + 1's events only after phase 2 of
// call k, which every peer reaches only after its waits on call k's events (steps 2 and 5).
// Every rank makes its calls in program order, so the k-th call of every rank is the same call.
#include "cuda/async_ce.h"

#include <strings.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace jax_blink::cuda_async {
namespace {

namespace jbc = jax_blink::cuda;

struct Slot {  // one rank's part of the current call, published before it meets the peers
  int device = -1;
  const char* in = nullptr;
  char* out = nullptr;
  cudaEvent_t ready = nullptr, reduced = nullptr, finished = nullptr;
  int64_t calls = 0;
};

struct Group {
  explicit Group(int n) : slots(n) {}
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Slot> slots;
  int64_t arrivals[3] = {0, 0, 0};
  std::string failed;  // set by the first rank that timed out: every later call fails with it
};

struct Scratch {
  void* p = nullptr;
  size_t bytes = 0;
};

std::mutex g_mu;  // the maps below (a group's own fields: its mutex)
std::map<int64_t, std::unique_ptr<Group>> g_groups;
std::map<int, Scratch> g_scratch;  // per device: one side stream orders every use

std::string CudaErr(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

Group* GroupOf(int64_t comm_id, int n) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::unique_ptr<Group>& g = g_groups[comm_id];
  if (!g) g = std::make_unique<Group>(n);
  return g.get();
}

const char* const kPhase[3] = {"its operand ready", "its chunk reduced", "its copies done"};

// Counts this rank in `phase` of call `call` and waits until every rank of the group has.
std::string Meet(Group& g, int phase, int rank, int64_t call, int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(g.mu);
  if (!g.failed.empty()) return g.failed;
  ++g.arrivals[phase];
  g.cv.notify_all();
  const int64_t need = call * static_cast<int64_t>(g.slots.size());
  const bool met = g.cv.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                                 [&] { return g.arrivals[phase] >= need || !g.failed.empty(); });
  if (!g.failed.empty()) return g.failed;
  if (!met) {
    int missing = -1;
    for (size_t s = 0; s < g.slots.size(); ++s)
      if (g.slots[s].calls < call) missing = static_cast<int>(s);
    g.failed = "rank " + std::to_string(rank) + " waited " + std::to_string(timeout_ms) + " ms for its peers (" +
               (missing >= 0 ? "rank " + std::to_string(missing) + " had not started call #" + std::to_string(call)
                             : std::string("every rank had started call #") + std::to_string(call)) +
               ") at '" + kPhase[phase] + "': a rank skipped this collective or is stuck. This collective (copy "
               "engines) fails from now on; restart the program";
    g.cv.notify_all();
    return g.failed;
  }
  return {};
}

std::string EnsureScratch(int device, size_t bytes, cudaStream_t side, void** out) {
  std::lock_guard<std::mutex> lock(g_mu);
  Scratch& s = g_scratch[device];
  if (s.bytes < bytes) {
    // Earlier calls on this side stream may still read the old buffer.
    cudaError_t e = cudaStreamSynchronize(side);
    if (e == cudaSuccess && s.p != nullptr) e = cudaFree(s.p);
    s.p = nullptr;
    s.bytes = 0;
    if (e == cudaSuccess) e = cudaMalloc(&s.p, bytes);
    if (e != cudaSuccess) return CudaErr("the copy engines' scratch buffer", e);
    s.bytes = bytes;
  }
  *out = s.p;
  return {};
}

}  // namespace

std::string AsyncEngineIsCopyEngines(bool* ce) {
  const char* v = std::getenv("JAX_BLINK_ASYNC_ENGINE");
  *ce = false;
  if (v == nullptr || *v == '\0' || strcasecmp(v, "sm") == 0) return {};
  if (strcasecmp(v, "ce") == 0) {
    *ce = true;
    return {};
  }
  return std::string("JAX_BLINK_ASYNC_ENGINE='") + v +
         "' is not understood: it takes sm (the executor's kernel moves the bytes) or ce (copy engines move "
         "them, a few blocks add them up); fix or unset it (unset: sm)";
}

std::string StartWithCopyEngines(int64_t comm_id, int rank, int nranks, int device, jbc::DType dtype, int32_t op,
                                 const void* in, void* out, int64_t elems, int esize, int blocks, cudaStream_t side,
                                 int64_t timeout_ms) {
  if (nranks < 2 || nranks > 64 || rank < 0 || rank >= nranks) return "bad rank or rank count";
  Group& g = *GroupOf(comm_id, nranks);
  const int64_t align = 16 / esize;
  const int64_t c = ((elems + nranks - 1) / nranks + align - 1) / align * align;  // elements per chunk
  auto first = [&](int s) { return std::min<int64_t>(elems, s * c); };
  auto count = [&](int s) { return std::min<int64_t>(elems, (s + 1) * c) - first(s); };
  const char* x = static_cast<const char*>(in);
  char* y = static_cast<char*>(out);
  void* scratch = nullptr;
  if (std::string err = EnsureScratch(device, static_cast<size_t>((nranks - 1) * c * esize), side, &scratch);
      !err.empty())
    return err;
  int64_t call = 0;
  {
    std::lock_guard<std::mutex> lock(g.mu);
    if (!g.failed.empty()) return g.failed;
    Slot& me = g.slots[rank];
    if (me.ready == nullptr) {
      cudaError_t e = cudaEventCreateWithFlags(&me.ready, cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&me.reduced, cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&me.finished, cudaEventDisableTiming);
      if (e != cudaSuccess) return CudaErr("creating the copy engines' events", e);
    }
    me.device = device;
    me.in = x;
    me.out = y;
    call = ++me.calls;
    const cudaError_t e = cudaEventRecord(me.ready, side);
    if (e != cudaSuccess) return CudaErr("recording 'ready'", e);
  }
  if (std::string err = Meet(g, 0, rank, call, timeout_ms); !err.empty()) return err;
  // 2-3: the peers' terms of chunk r, then the reduction in rank order.
  const void* terms[64];
  for (int s = 0, k = 0; s < nranks; ++s) {
    if (s == rank) {
      terms[s] = x + first(rank) * esize;
      continue;
    }
    char* dst = static_cast<char*>(scratch) + static_cast<int64_t>(k++) * c * esize;
    terms[s] = dst;
    const Slot& p = g.slots[s];
    cudaError_t e = cudaStreamWaitEvent(side, p.ready, 0);
    if (e == cudaSuccess && count(rank) > 0)
      e = cudaMemcpyPeerAsync(dst, device, p.in + first(rank) * esize, p.device, count(rank) * esize, side);
    if (e != cudaSuccess) return CudaErr("copying a peer's term (copy engine)", e);
  }
  if (std::string err = jbc::LaunchReduceTerms(dtype, op, y + first(rank) * esize, terms, nranks, count(rank), blocks, side);
      !err.empty())
    return err;
  cudaError_t e = cudaEventRecord(g.slots[rank].reduced, side);
  if (e != cudaSuccess) return CudaErr("recording 'reduced'", e);
  if (std::string err = Meet(g, 1, rank, call, timeout_ms); !err.empty()) return err;
  // 5: every peer's reduced chunk.
  for (int s = 0; s < nranks; ++s) {
    if (s == rank) continue;
    const Slot& p = g.slots[s];
    e = cudaStreamWaitEvent(side, p.reduced, 0);
    if (e == cudaSuccess && count(s) > 0)
      e = cudaMemcpyPeerAsync(y + first(s) * esize, device, p.out + first(s) * esize, p.device, count(s) * esize, side);
    if (e != cudaSuccess) return CudaErr("copying a peer's reduced chunk (copy engine)", e);
  }
  e = cudaEventRecord(g.slots[rank].finished, side);
  if (e != cudaSuccess) return CudaErr("recording 'finished'", e);
  if (std::string err = Meet(g, 2, rank, call, timeout_ms); !err.empty()) return err;
  for (int s = 0; s < nranks; ++s) {
    if (s == rank) continue;
    e = cudaStreamWaitEvent(side, g.slots[s].finished, 0);
    if (e != cudaSuccess) return CudaErr("waiting for a peer's copies", e);
  }
  return {};
}

}  // namespace jax_blink::cuda_async
