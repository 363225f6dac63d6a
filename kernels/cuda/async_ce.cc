// The copy-engine form of the all-reduce (docs/overlap.md): what async_ffi.cc's start handler runs
// for a site set up with JAX_BLINK_ASYNC_ENGINE=ce, and module.cc's synchronous handler for a
// two-shot site set up with JAX_BLINK_TWOSHOT_ENGINE=ce (on XLA's stream as `side`).
//
// Why: the executor's kernels move every byte with SM loads and stores, and beside the backward
// pass they take SMs and memory bandwidth from it. Here the copy engines move the bytes and a few
// blocks only add them up.
//
// One call, rank r of n, chunk s = elements [s c, (s + 1) c) (c a whole number of 16-byte atoms),
// each chunk cut into Q pieces (piece_bytes each, at most kMaxPieces):
//   1. record `ready` on the side stream (x is written, out is free); meet the peers (phase 0);
//   2. per peer, on a copy stream of its own (so that several copy engines run at once; peer r + i
//      first, so that no rank is every reader's first source), after the peer's `ready`, one of two
//      ways (JAX_BLINK_CE_SCATTER), one event per piece:
//      pull (default): copy the peer's pieces of chunk r into this device's scratch;
//      push: copy this rank's pieces of the peer's chunk into the peer's scratch (its slot for this
//        rank), then meet (phase 3, "its terms sent": every rank's events of this call are
//        recorded). Copy engines that write across NVLink keep their rate with 3 peers at once,
//        ones that read do not (benchmarks/link_probe.py, 4 x H200: 373 against 196 GB/s per GPU),
//        yet the all-reduce pushed is still slower than psum there (NOTES, change 21);
//   3. on the side stream, per piece: wait for every peer's copy of it, reduce it in rank order
//      into out (this rank's term from x), record `reduced[q]`;
//   4. the all-gather, per peer on its copy stream, one of two ways (JAX_BLINK_CE_GATHER):
//      pull (default): meet (phase 1), then copy each piece of the peer's reduced chunk into out
//        once the peer's `reduced[q]` has passed;
//      push: copy each reduced piece of chunk r into the peer's out (free since the peer's
//        `ready`) once this rank's `reduced[q]` has passed: no meeting, no wait on a peer's event
//        per piece, but the copy engines write across NVLink instead of reading;
//   5. the side stream waits for its copy streams, records `finished`; meet (phase 2); waits for
//      every peer's `finished`: every copy into this out has landed, and no peer reads this x or
//      out any more, once the side stream passes here.
// Why the events are the right ones: a rank records call k + 1's events only after phase 2 of
// call k, which every peer reaches only after it enqueued its waits on call k's events
// (a wait captures the event's record at the time it is enqueued; a pushed piece's event is waited
// on only after phase 3, when its record of this call is made). Every rank makes its calls in
// program order, so the k-th call of every rank is the same call. The copy streams start after
// `ready` and end before `finished` on the side stream: the scratch and the events of one device
// are never used by two calls at once.
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

constexpr int kMaxRanks = 64;
constexpr int kMaxPieces = 16;  // per chunk: each extra piece cost about 12 us per copy on 2 x H200 (NOTES, change 19)

struct Slot {  // one rank's part of the current call, published before it meets the peers
  int device = -1;
  const char* in = nullptr;
  char* out = nullptr;
  char* scratch = nullptr;              // the device's scratch: where pushing peers write
  const cudaEvent_t* pushed = nullptr;  // pushed[(i - 1) * kMaxPieces + q]: piece q to rank + i has landed
  cudaEvent_t ready = nullptr, finished = nullptr;
  cudaEvent_t reduced[kMaxPieces] = {};  // piece q of this rank's chunk is reduced
  int64_t calls = 0;
};

struct Group {
  explicit Group(int n) : slots(n) {}
  int64_t piece_bytes = kDefaultPieceBytes;  // JAX_BLINK_CE_PIECE_BYTES, read when the group is made
  bool push = false;                         // JAX_BLINK_CE_GATHER=push, likewise
  bool scatter_push = false;                 // JAX_BLINK_CE_SCATTER=push, likewise
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Slot> slots;
  int64_t arrivals[4] = {0, 0, 0, 0};
  std::string failed;  // set by the first rank that timed out: every later call fails with it
};

// Per device: the scratch of the peers' terms, a copy stream per peer and their events. The side
// stream orders every use (see the file's comment).
struct DeviceState {
  int sms = 0;  // the device's SM count: the grid of a reduction on every SM
  void* scratch = nullptr;
  size_t bytes = 0;
  std::vector<cudaStream_t> copy;     // copy[i - 1]: the stream of peer rank + i
  std::vector<cudaEvent_t> piece;     // piece[(i - 1) * kMaxPieces + q]: peer i's piece q is here (pull) or
                                      // this rank's piece q is in peer i's scratch (push)
  std::vector<cudaEvent_t> gathered;  // gathered[i - 1]: this rank's all-gather copies with peer i are done
};

std::mutex g_mu;  // the maps below (a group's own fields: its mutex)
std::map<int64_t, std::unique_ptr<Group>> g_groups;
std::map<int, DeviceState> g_devices;

std::string CudaErr(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

std::string PieceBytes(int64_t* bytes);
std::string GatherPushes(bool* push);
std::string ScatterPushes(bool* push);

// The group of call site `comm_id`, made (with its settings from the environment) at its first call.
// A group enters the map only once its settings are read: a value not understood leaves no entry,
// so every entry that ResetCopyEngines walks holds a group.
std::string GroupOf(int64_t comm_id, int n, Group** out) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_groups.find(comm_id);
  if (it == g_groups.end()) {
    auto made = std::make_unique<Group>(n);
    if (std::string err = PieceBytes(&made->piece_bytes); !err.empty()) return err;
    if (std::string err = GatherPushes(&made->push); !err.empty()) return err;
    if (std::string err = ScatterPushes(&made->scatter_push); !err.empty()) return err;
    it = g_groups.emplace(comm_id, std::move(made)).first;
  }
  *out = it->second.get();
  return {};
}

const char* const kPhase[4] = {"its operand ready", "its chunk reduced", "its copies done", "its terms sent"};

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
               "engines) fails from now on, until jax_blink.reset() (with no collective running) or a restart";
    g.cv.notify_all();
    return g.failed;
  }
  return {};
}

// This device's state with `peers` copy streams and a scratch of at least `bytes`.
std::string DeviceStateOf(int device, int peers, size_t bytes, cudaStream_t side, DeviceState** out) {
  std::lock_guard<std::mutex> lock(g_mu);
  DeviceState& d = g_devices[device];
  cudaError_t e = d.sms > 0 ? cudaSuccess : cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device);
  while (e == cudaSuccess && static_cast<int>(d.copy.size()) < peers) {
    cudaStream_t s = nullptr;
    e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) break;
    d.copy.push_back(s);
    cudaEvent_t g = nullptr;
    e = cudaEventCreateWithFlags(&g, cudaEventDisableTiming);
    if (e != cudaSuccess) break;
    d.gathered.push_back(g);
    for (int q = 0; q < kMaxPieces && e == cudaSuccess; ++q) {
      cudaEvent_t p = nullptr;
      e = cudaEventCreateWithFlags(&p, cudaEventDisableTiming);
      if (e == cudaSuccess) d.piece.push_back(p);
    }
  }
  if (e != cudaSuccess || d.piece.size() < d.copy.size() * kMaxPieces)
    return CudaErr("creating the copy engines' streams and events", e == cudaSuccess ? cudaErrorUnknown : e);
  if (d.bytes < bytes) {
    // Earlier calls on this side stream may still read the old buffer.
    e = cudaStreamSynchronize(side);
    if (e == cudaSuccess && d.scratch != nullptr) e = cudaFree(d.scratch);
    d.scratch = nullptr;
    d.bytes = 0;
    if (e == cudaSuccess) e = cudaMalloc(&d.scratch, bytes);
    if (e != cudaSuccess) return CudaErr("the copy engines' scratch buffer", e);
    d.bytes = bytes;
  }
  *out = &d;
  return {};
}

}  // namespace

namespace {

// Variable `name`: unset, "" or `first` -> false, `second` -> true (any case); else an error
// message naming the value and what each choice does.
std::string EnvChoice(const char* name, const char* first, const char* second, const char* what, bool* is_second) {
  const char* v = std::getenv(name);
  *is_second = false;
  if (v == nullptr || *v == '\0' || strcasecmp(v, first) == 0) return {};
  if (strcasecmp(v, second) == 0) {
    *is_second = true;
    return {};
  }
  return std::string(name) + "='" + v + "' is not understood: it takes " + what + "; fix or unset it (unset: " +
         first + ")";
}

std::string PieceBytes(int64_t* bytes) {
  *bytes = kDefaultPieceBytes;
  const char* v = std::getenv("JAX_BLINK_CE_PIECE_BYTES");
  if (v == nullptr || *v == '\0') return {};
  int64_t b = 0;
  if (!jbc::ParseByteCount(v, &b) || b < 16)
    return std::string("JAX_BLINK_CE_PIECE_BYTES='") + v +
           "' is not understood: it takes a byte count of at least 16, such as 4M or 16M (the pieces the copy "
           "engines' all-reduce pipelines; unset: " + std::to_string(kDefaultPieceBytes >> 20) + "M)";
  *bytes = b;
  return {};
}

std::string GatherPushes(bool* push) {
  return EnvChoice("JAX_BLINK_CE_GATHER", "pull", "push",
                   "pull (each rank reads its peers' reduced chunks) or push (each rank writes its reduced chunk "
                   "into its peers)",
                   push);
}

std::string ScatterPushes(bool* push) {
  return EnvChoice("JAX_BLINK_CE_SCATTER", "pull", "push",
                   "pull (each rank reads its peers' terms of its chunk) or push (each rank writes its terms into "
                   "its peers)",
                   push);
}

}  // namespace

std::string AsyncEngineIsCopyEngines(bool* ce) {
  return EnvChoice("JAX_BLINK_ASYNC_ENGINE", "sm", "ce",
                   "sm (the executor's kernel moves the bytes) or ce (copy engines move them, a few blocks add them up)",
                   ce);
}

std::string CheckCopyEngineEnvironment() {
  bool flag = false;
  int64_t bytes = 0;
  if (std::string err = AsyncEngineIsCopyEngines(&flag); !err.empty()) return err;
  if (std::string err = PieceBytes(&bytes); !err.empty()) return err;
  if (std::string err = ScatterPushes(&flag); !err.empty()) return err;
  return GatherPushes(&flag);
}

std::string StartWithCopyEngines(int64_t comm_id, int rank, int nranks, int device, jbc::DType dtype, int32_t op,
                                 const void* in, void* out, int64_t elems, int esize, int blocks, cudaStream_t side,
                                 int64_t timeout_ms) {
  if (nranks < 2 || nranks > kMaxRanks || rank < 0 || rank >= nranks) return "bad rank or rank count";
  Group* group = nullptr;
  if (std::string err = GroupOf(comm_id, nranks, &group); !err.empty()) return err;
  Group& g = *group;
  const int64_t piece_bytes = g.piece_bytes;
  const bool push = g.push, scatter_push = g.scatter_push;
  const int64_t align = 16 / esize;
  const int64_t c = ((elems + nranks - 1) / nranks + align - 1) / align * align;  // elements per chunk
  // Elements per piece: a whole number of atoms, and at most kMaxPieces pieces per chunk.
  const int64_t want = std::max<int64_t>(align, piece_bytes / esize / align * align);
  const int64_t at_least = ((c + kMaxPieces - 1) / kMaxPieces + align - 1) / align * align;
  const int64_t pe = std::max(want, at_least);
  const int pieces = static_cast<int>(std::max<int64_t>(1, (c + pe - 1) / pe));
  auto first = [&](int s) { return std::min<int64_t>(elems, s * c); };
  auto count = [&](int s) { return std::min<int64_t>(elems, (s + 1) * c) - first(s); };
  // Piece q of chunk s: elements [first(s) + q pe, ...), piece_count of them.
  auto piece_count = [&](int s, int q) { return std::max<int64_t>(0, std::min<int64_t>(pe, count(s) - q * pe)); };
  const char* x = static_cast<const char*>(in);
  char* y = static_cast<char*>(out);
  DeviceState* d = nullptr;
  if (std::string err = DeviceStateOf(device, nranks - 1, static_cast<size_t>((nranks - 1) * c * esize), side, &d);
      !err.empty())
    return err;
  if (blocks <= 0) blocks = d->sms;
  int64_t call = 0;
  {
    std::lock_guard<std::mutex> lock(g.mu);
    if (!g.failed.empty()) return g.failed;
    Slot& me = g.slots[rank];
    if (me.ready == nullptr) {
      cudaError_t e = cudaEventCreateWithFlags(&me.ready, cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&me.finished, cudaEventDisableTiming);
      for (int q = 0; q < kMaxPieces && e == cudaSuccess; ++q)
        e = cudaEventCreateWithFlags(&me.reduced[q], cudaEventDisableTiming);
      if (e != cudaSuccess) return CudaErr("creating the copy engines' events", e);
    }
    me.device = device;
    me.in = x;
    me.out = y;
    me.scratch = static_cast<char*>(d->scratch);
    me.pushed = d->piece.data();
    call = ++me.calls;
    const cudaError_t e = cudaEventRecord(me.ready, side);
    if (e != cudaSuccess) return CudaErr("recording 'ready'", e);
  }
  if (std::string err = Meet(g, 0, rank, call, timeout_ms); !err.empty()) return err;
  const Slot& me = g.slots[rank];
  // 2: the terms of chunk r from the peers (pull), or this rank's terms of every peer's chunk into
  // the peers (push), each peer on its own copy stream. Scratch slot i - 1 of rank r holds the term
  // of rank r + i.
  const char* terms[kMaxRanks];  // where each rank's term of chunk r lies on this device
  terms[rank] = x + first(rank) * esize;
  for (int i = 1; i < nranks; ++i) {
    const int s = (rank + i) % nranks;
    const Slot& p = g.slots[s];
    cudaStream_t cs = d->copy[i - 1];
    char* dst = static_cast<char*>(d->scratch) + static_cast<int64_t>(i - 1) * c * esize;
    terms[s] = dst;
    cudaError_t e = cudaStreamWaitEvent(cs, me.ready, 0);  // after the previous call's reduction
    if (e == cudaSuccess) e = cudaStreamWaitEvent(cs, p.ready, 0);  // the peer's scratch is free, its x written
    // Push: this rank's term goes into the peer's slot for rank r, i.e. its slot n - i - 1.
    char* peer_dst = p.scratch + static_cast<int64_t>(nranks - i - 1) * c * esize;
    for (int q = 0; q < pieces && e == cudaSuccess; ++q) {
      const int64_t off = q * pe * esize;
      if (scatter_push) {
        const int64_t n = piece_count(s, q);
        if (n > 0) e = cudaMemcpyPeerAsync(peer_dst + off, p.device, x + first(s) * esize + off, device, n * esize, cs);
      } else {
        const int64_t n = piece_count(rank, q);
        if (n > 0) e = cudaMemcpyPeerAsync(dst + off, device, p.in + first(rank) * esize + off, p.device, n * esize, cs);
      }
      if (e == cudaSuccess) e = cudaEventRecord(d->piece[(i - 1) * kMaxPieces + q], cs);
    }
    if (e != cudaSuccess) return CudaErr("copying a peer's term (copy engine)", e);
  }
  // 3: each piece reduced as soon as every peer's copy of it is here. Pushed pieces: after phase 3,
  // when every peer has recorded its events of this call; rank r + i pushed into slot i - 1 with
  // its copy stream n - i.
  if (scatter_push)
    if (std::string err = Meet(g, 3, rank, call, timeout_ms); !err.empty()) return err;
  for (int q = 0; q < pieces; ++q) {
    cudaError_t e = cudaSuccess;
    for (int i = 1; i < nranks && e == cudaSuccess; ++i)
      e = cudaStreamWaitEvent(side, scatter_push ? g.slots[(rank + i) % nranks].pushed[(nranks - i - 1) * kMaxPieces + q]
                                                 : d->piece[(i - 1) * kMaxPieces + q], 0);
    if (e != cudaSuccess) return CudaErr("waiting for a peer's term", e);
    const int64_t off = q * pe * esize, n = piece_count(rank, q);
    if (n > 0) {
      const void* piece_terms[kMaxRanks];
      for (int s = 0; s < nranks; ++s) piece_terms[s] = terms[s] + off;
      if (std::string err = jbc::LaunchReduceTerms(dtype, op, y + first(rank) * esize + off, piece_terms, nranks, n,
                                                   blocks, side);
          !err.empty())
        return err;
    }
    e = cudaEventRecord(me.reduced[q], side);
    if (e != cudaSuccess) return CudaErr("recording 'reduced'", e);
  }
  // 4: the all-gather, piece by piece.
  if (!push)
    if (std::string err = Meet(g, 1, rank, call, timeout_ms); !err.empty()) return err;
  for (int i = 1; i < nranks; ++i) {
    const int s = (rank + i) % nranks;
    const Slot& p = g.slots[s];
    cudaStream_t cs = d->copy[i - 1];
    cudaError_t e = cudaSuccess;
    for (int q = 0; q < pieces && e == cudaSuccess; ++q) {
      if (push) {  // this rank's reduced piece into the peer's out
        const int64_t off = first(rank) * esize + q * pe * esize, n = piece_count(rank, q);
        e = cudaStreamWaitEvent(cs, me.reduced[q], 0);
        if (e == cudaSuccess && n > 0) e = cudaMemcpyPeerAsync(p.out + off, p.device, y + off, device, n * esize, cs);
      } else {  // the peer's reduced piece into this out
        const int64_t off = first(s) * esize + q * pe * esize, n = piece_count(s, q);
        e = cudaStreamWaitEvent(cs, p.reduced[q], 0);
        if (e == cudaSuccess && n > 0) e = cudaMemcpyPeerAsync(y + off, device, p.out + off, p.device, n * esize, cs);
      }
    }
    if (e == cudaSuccess) e = cudaEventRecord(d->gathered[i - 1], cs);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(side, d->gathered[i - 1], 0);
    if (e != cudaSuccess) return CudaErr("the all-gather's copies (copy engine)", e);
  }
  // 5.
  cudaError_t e = cudaEventRecord(me.finished, side);
  if (e != cudaSuccess) return CudaErr("recording 'finished'", e);
  if (std::string err = Meet(g, 2, rank, call, timeout_ms); !err.empty()) return err;
  for (int s = 0; s < nranks; ++s) {
    if (s == rank) continue;
    e = cudaStreamWaitEvent(side, g.slots[s].finished, 0);
    if (e != cudaSuccess) return CudaErr("waiting for a peer's copies", e);
  }
  return {};
}

std::string ResetCopyEngines() {
  std::lock_guard<std::mutex> lock(g_mu);
  int saved = -1;
  cudaGetDevice(&saved);
  std::string err;
  for (auto& [comm_id, g] : g_groups) {
    std::lock_guard<std::mutex> group_lock(g->mu);
    for (Slot& s : g->slots) {
      if (s.ready == nullptr) continue;
      cudaError_t e = cudaSetDevice(s.device);
      for (cudaEvent_t ev : {s.ready, s.finished})
        if (e == cudaSuccess) e = cudaEventDestroy(ev);
      for (cudaEvent_t ev : s.reduced)
        if (e == cudaSuccess) e = cudaEventDestroy(ev);
      if (e != cudaSuccess && err.empty()) err = CudaErr("releasing the copy engines' events", e);
    }
  }
  g_groups.clear();
  if (saved >= 0) cudaSetDevice(saved);
  return err;
}

}  // namespace jax_blink::cuda_async
