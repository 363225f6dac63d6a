// CPU back end of "jax_blink_collective": see cpu_executor.h and program.h.
//
// ## Shape of the executor
// XLA's CPU client runs each host device's program on its own thread and nothing orders the
// launches of different devices. Every call of the custom call looks up the communicator of its
// (comm_id, group): comm_id names the lowered call site, group the slice of the other mesh axes.
// A communicator holds, per rank, a slot (this call's in/out pointers, the rank's call count) and
// per tree two progress words, reduce and broadcast, each (seq << 32 | chunks done), where seq is
// the call count of that rank: the k-th call of the communicator by a rank has seq k, so the
// words only grow and a word of call k-1 never satisfies a wait of call k. A rank publishes a word
// only after it wrote the chunk into its `out`; peers read that `out` directly (one process, host
// pointers are shared), as GPUs read a peer's buffer under peer access.
//
// Waits take the watched rank's mutex and condition variable (no busy spinning: up to 32 host
// devices share 2 cores); a publisher takes its own mutex to store the word and notifies only when
// somebody waits. Every wait has its own deadline of timeout_ms.
//
// ## Order, and why it cannot deadlock
// Every rank runs the same steps in the same order: trees in program order, in each tree all reduce
// chunks, then all broadcast chunks; then its exit waits. Name a step by its key (t, phase, c),
// ordered lexicographically with reduce < broadcast. A reduce step (r, t, R, c) waits only for the
// children of r to finish their step (t, R, c); a broadcast step (r, t, B, c) waits only for the
// parent of r to finish (t, B, c). An exit wait waits for a peer to finish one step of some key.
// Suppose all ranks of a call are present and some are blocked forever. Among the steps blocked
// ranks wait for, take one with the smallest key K, waited for by rank a on peer b. b has not
// finished K, and b runs steps in key order, so b is not past K; b is not finished, so it is
// blocked, and it waits at its current step, of key <= K; by minimality exactly K: b waits for a
// step of key K too. Within one key the waits follow tree edges in one direction (children for R,
// parent for B), so the chain a -> b -> ... strictly descends (R) or ascends (B) a tree, which the
// program validation guarantees is acyclic: the chain ends at a leaf (R: waits for nobody) or at
// the root (B: its chunk is final after its own reduce, earlier in its order). Contradiction. The
// root publishes its broadcast word right after reducing each chunk (its broadcast phase has
// nothing to do), which only removes waits. Different comm_ids are independent communicators; if
// XLA ever ran two of them in different orders on different devices, the deadlines end it.
//
// ## When a rank may return
// XLA may reuse a buffer once the call returns, so a rank returns only when no peer will read its
// `out` any more: in a tree with a broadcast phase its children read it (the exit waits for each
// child's last broadcast word; the parent's reduce reads are over by then, since the parent
// broadcasts only after its whole reduce phase and this rank waited for that); in a reduce-only
// tree its parent reads it (the exit waits for the parent's last reduce word). Nobody reads `in`,
// so `in` may alias `out` (donation): each element of `out` is written from `in` and the children
// at the same index only.
//
// ## Faults: deadlines, failure, and getting back to work
// A wait past its deadline marks the communicator failed (first failure's message kept), wakes
// every waiter of it, and returns DEADLINE_EXCEEDED naming the rank, device, group, the awaited
// rank, tree, chunk, phase, call number and comm_id. Woken waiters return ABORTED quoting that
// message. A failing rank waits until no peer is in the middle of copying from its buffers (each
// read brackets itself with a per-slot reader count and re-checks the failure flag, Dekker-style),
// so a peer never reads freed memory. Mismatched programs, dtypes, ops, or two calls claiming one
// rank also fail the communicator at once (INVALID_ARGUMENT), so the others fail fast instead of
// waiting out their deadline.
// A failed communicator does not touch any other comm_id. Each rank that leaves a failed call or
// enters the failed communicator "acknowledges" the failure; entering calls fail fast (ABORTED)
// with the original message and how many ranks have acknowledged. When all nranks have
// acknowledged and no call is in flight, the communicator resets itself: counters, call counts and
// program are dropped, and the next call of every rank is call #1 again, so the ranks line up.
// E.g. a rank skipped under lax.cond: run 1 times out on the others; while the rank keeps skipping,
// every run fails fast; the first run where it takes part fails fast on every rank (it is the last
// to acknowledge) and resets; the run after works. `_blink_cpu.reset()` drops everything at once.

#include "cpu_executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "program.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_blink::cpu {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kDefaultTimeoutMs = 10000;
constexpr int kReduce = 0, kBroadcast = 1;

// ---------------------------------------------------------------------------------------------
// Element types and the combining ops.

uint32_t F32Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float BitsF32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

// Round to nearest even, NaN stays a (quiet) NaN: as ml_dtypes does.
inline uint16_t F32ToBf16(float f) {
  uint32_t u = F32Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE half <-> float (F. Giesen's exact conversions; round to nearest even, subnormals kept).
inline float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t o = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = o & 0x0f800000u;
  o += (127u - 15u) << 23;
  if (exp == 0x0f800000u) {
    o += (128u - 16u) << 23;  // Inf, NaN
  } else if (exp == 0) {      // zero, subnormal: renormalise through the FPU
    o += 1u << 23;
    o = F32Bits(BitsF32(o) - BitsF32(113u << 23));
  }
  return BitsF32(o | sign);
}

inline uint16_t F32ToF16(float fin) {
  const uint32_t f32infty = 255u << 23, f16max = (127u + 16u) << 23;
  const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t f = F32Bits(fin);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint16_t o;
  if (f >= f16max) {
    o = f > f32infty ? 0x7e00 : 0x7c00;
  } else if (f < (113u << 23)) {
    o = static_cast<uint16_t>(F32Bits(BitsF32(f) + BitsF32(denorm_magic)) - denorm_magic);
  } else {
    const uint32_t odd = (f >> 13) & 1u;
    f += 0xc8000fffu;  // ((15 - 127) << 23) + 0xfff, modulo 2^32
    f += odd;
    o = static_cast<uint16_t>(f >> 13);
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

template <class T>
struct Elem {
  using Acc = T;
  static Acc Load(T v) { return v; }
  static T Store(Acc a) { return a; }
};
template <>
struct Elem<Bf16> {
  using Acc = float;
  static float Load(Bf16 v) { return BitsF32(static_cast<uint32_t>(v.bits) << 16); }
  static Bf16 Store(float a) { return Bf16{F32ToBf16(a)}; }
};
template <>
struct Elem<F16> {
  using Acc = float;
  static float Load(F16 v) { return F16ToF32(v.bits); }
  static F16 Store(float a) { return F16{F32ToF16(a)}; }
};

// numpy's semantics: NaN propagates; on ties the first operand wins.
struct SumOp {
  template <class A>
  static A Apply(A a, A b) {
    if constexpr (std::is_integral_v<A>) {  // wraps, like XLA (no signed-overflow UB)
      using U = std::make_unsigned_t<A>;
      return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  }
};
struct MaxOp {
  template <class A>
  static A Apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) return (a >= b || a != a) ? a : b;
    else return a >= b ? a : b;
  }
};
struct MinOp {
  template <class A>
  static A Apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) return (a <= b || a != a) ? a : b;
    else return a <= b ? a : b;
  }
};

// out[i] = in[i] op kids[0][i] op kids[1][i] ...  (left to right; 16-bit types in float32 with
// one rounding at the end). `out` may alias `in`, never a kid.
using ReduceFn = void (*)(void* out, const void* in, const void* const* kids, int nkids, int64_t n);

template <class T, class Op>
void ReduceChunk(void* out_v, const void* in_v, const void* const* kids_v, int nkids, int64_t n) {
  T* out = static_cast<T*>(out_v);
  const T* in = static_cast<const T*>(in_v);
  using E = Elem<T>;
  using A = typename E::Acc;
  if constexpr (std::is_same_v<T, A>) {
    const T* k0 = static_cast<const T*>(kids_v[0]);
    for (int64_t i = 0; i < n; ++i) out[i] = Op::Apply(in[i], k0[i]);
    for (int k = 1; k < nkids; ++k) {
      const T* kk = static_cast<const T*>(kids_v[k]);
      for (int64_t i = 0; i < n; ++i) out[i] = Op::Apply(out[i], kk[i]);
    }
  } else {
    constexpr int64_t kBlock = 1024;
    A acc[kBlock];
    for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
      const int64_t m = std::min(kBlock, n - i0);
      for (int64_t j = 0; j < m; ++j) acc[j] = E::Load(in[i0 + j]);
      for (int k = 0; k < nkids; ++k) {
        const T* kk = static_cast<const T*>(kids_v[k]) + i0;
        for (int64_t j = 0; j < m; ++j) acc[j] = Op::Apply(acc[j], E::Load(kk[j]));
      }
      for (int64_t j = 0; j < m; ++j) out[i0 + j] = E::Store(acc[j]);
    }
  }
}

template <class T>
ReduceFn PickOp(int32_t op) {
  switch (op) {
    case 0: return &ReduceChunk<T, SumOp>;
    case 1: return &ReduceChunk<T, MaxOp>;
    case 2: return &ReduceChunk<T, MinOp>;
  }
  return nullptr;
}

// nullptr for an unsupported dtype.
ReduceFn PickReduce(ffi::DataType dtype, int32_t op) {
  switch (dtype) {
    case ffi::DataType::F32: return PickOp<float>(op);
    case ffi::DataType::F64: return PickOp<double>(op);
    case ffi::DataType::BF16: return PickOp<Bf16>(op);
    case ffi::DataType::F16: return PickOp<F16>(op);
    case ffi::DataType::S32: return PickOp<int32_t>(op);
    case ffi::DataType::S64: return PickOp<int64_t>(op);
    default: return nullptr;
  }
}

const char* DtypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    default: return "an unsupported type";
  }
}

const char* OpName(int32_t op) { return op == 0 ? "sum" : op == 1 ? "max" : op == 2 ? "min" : "?"; }

// ---------------------------------------------------------------------------------------------
// Communicator state.

struct Slot {
  // Guards the progress words' updates (not their reads) and the condition variable.
  std::mutex mu;
  std::condition_variable cv;
  int waiters = 0;                        // under mu
  std::atomic<const void*> in{nullptr};   // this call's buffers (stored at entry, before any
  std::atomic<void*> out{nullptr};        // progress word of the call: its acquire publishes them)
  std::atomic<int> readers{0};            // peers copying from `out` right now
  // Under Comm::mu:
  uint64_t seq = 0;       // calls this rank started since the last reset
  bool in_call = false;
  bool acked = false;     // has seen the current failure
  int device = -1;
};

struct Comm {
  Comm(int64_t id, int32_t g) : comm_id(id), group(g) {}
  const int64_t comm_id;
  const int32_t group;

  std::mutex mu;
  // Configuration: written under mu while no call is in flight; read freely by calls in flight.
  bool configured = false;
  std::vector<int32_t> words;  // the program, as the first rank brought it
  Program program;             // decoded over `words`
  ffi::DataType dtype = ffi::DataType::INVALID;
  int32_t op = 0;
  int nranks = 0, ntrees = 0;
  std::vector<int32_t> child_begin;  // children of r in tree t: child_list[child_begin[t*n+r] ..
  std::vector<int32_t> child_list;   //                                      child_begin[t*n+r+1])
  std::vector<std::pair<int64_t, int64_t>> gaps;  // (offset, len) outside every segment
  std::unique_ptr<Slot[]> slots;
  std::unique_ptr<std::atomic<uint64_t>[]> progress;  // [(r * ntrees + t) * 2 + phase]

  // Under mu (failed is also read without it).
  int in_flight = 0;
  std::atomic<bool> failed{false};
  std::string failure;
  int nacked = 0;

  std::atomic<uint64_t>& word(int r, int t, int phase) {
    return progress[(static_cast<size_t>(r) * ntrees + t) * 2 + phase];
  }

  // Under mu, with no call in flight.
  std::string Configure(const int32_t* data, int64_t size, ffi::DataType dt, int32_t the_op) {
    words.assign(data, data + size);
    std::string err = program.Decode(words.data(), size);
    if (!err.empty()) {
      words.clear();
      return err;
    }
    dtype = dt;
    op = the_op;
    nranks = program.nranks();
    ntrees = program.ntrees();
    child_begin.assign(static_cast<size_t>(ntrees) * nranks + 1, 0);
    child_list.assign(static_cast<size_t>(ntrees) * nranks, 0);
    // Counting sort by parent: children come out in ascending rank order.
    for (int t = 0; t < ntrees; ++t) {
      const TreeView& tv = program.tree(t);
      for (int r = 0; r < nranks; ++r)
        if (tv.parent[r] >= 0) ++child_begin[static_cast<size_t>(t) * nranks + tv.parent[r] + 1];
    }
    for (size_t i = 1; i < child_begin.size(); ++i) child_begin[i] += child_begin[i - 1];
    std::vector<int32_t> fill(child_begin.begin(), child_begin.end() - 1);
    for (int t = 0; t < ntrees; ++t) {
      const TreeView& tv = program.tree(t);
      for (int r = 0; r < nranks; ++r)
        if (tv.parent[r] >= 0) child_list[fill[static_cast<size_t>(t) * nranks + tv.parent[r]]++] = r;
    }
    gaps.clear();
    int64_t at = 0;
    for (int t : program.trees_by_offset()) {
      const TreeView& tv = program.tree(t);
      if (tv.seg_offset > at) gaps.emplace_back(at, tv.seg_offset - at);
      at = tv.seg_offset + tv.seg_len;
    }
    if (program.total_elems() > at) gaps.emplace_back(at, program.total_elems() - at);
    slots.reset(new Slot[nranks]);
    progress.reset(new std::atomic<uint64_t>[static_cast<size_t>(nranks) * ntrees * 2]);
    for (size_t i = 0; i < static_cast<size_t>(nranks) * ntrees * 2; ++i) progress[i].store(0);
    configured = true;
    return {};
  }

  // Under mu: forget everything once every rank has seen the failure and nobody is inside.
  void MaybeResetLocked() {
    if (!failed.load() || nacked < nranks || in_flight != 0) return;
    configured = false;
    words.clear();
    slots.reset();
    progress.reset();
    failure.clear();
    nacked = 0;
    failed.store(false);
  }

  // Under mu.
  void AckLocked(int rank) {
    if (rank < 0 || rank >= nranks || !slots) return;
    if (!slots[rank].acked) {
      slots[rank].acked = true;
      ++nacked;
    }
  }

  // Under mu. Marks the communicator failed (the first message wins); call WakeAll after unlock.
  void FailLocked(const std::string& msg) {
    if (!failed.load()) {
      failure = msg;
      failed.store(true);
    }
  }

  void WakeAll() {
    if (!slots) return;
    for (int r = 0; r < nranks; ++r) {
      std::lock_guard<std::mutex> g(slots[r].mu);
      slots[r].cv.notify_all();
    }
  }
};

std::mutex g_mu;
std::map<std::pair<int64_t, int32_t>, std::shared_ptr<Comm>> g_comms;
std::atomic<uint64_t> g_generation{1};  // bumped by ResetAll: invalidates the threads' caches

std::shared_ptr<Comm> GetComm(int64_t comm_id, int32_t group) {
  struct Cache {
    uint64_t generation = 0;
    int64_t comm_id = 0;
    int32_t group = 0;
    std::shared_ptr<Comm> comm;
  };
  thread_local Cache cache;
  const uint64_t gen = g_generation.load(std::memory_order_acquire);
  if (cache.generation == gen && cache.comm && cache.comm_id == comm_id && cache.group == group)
    return cache.comm;
  std::lock_guard<std::mutex> g(g_mu);
  auto& slot = g_comms[{comm_id, group}];
  if (!slot) slot = std::make_shared<Comm>(comm_id, group);
  cache = Cache{gen, comm_id, group, slot};
  return slot;
}

// ---------------------------------------------------------------------------------------------
// One call.

class Call {
 public:
  Call(Comm& comm, int rank, int device, uint64_t seq, int64_t timeout_ms)
      : c_(comm), rank_(rank), device_(device), seq_(seq), timeout_(timeout_ms) {}

  const std::string& error() const { return error_; }
  ffi::ErrorCode code() const { return code_; }

  std::string Who() const {
    return "jax_blink: rank " + std::to_string(rank_) + " (host device " + std::to_string(device_) +
           ", group " + std::to_string(c_.group) + ")";
  }
  std::string CallName() const {
    return "call #" + std::to_string(seq_) + " of collective " + std::to_string(c_.comm_id);
  }

  // Waits until `peer`'s progress word (t, phase) reaches `target` (chunk `chunk` is done).
  bool Wait(int peer, int t, int phase, int64_t chunk, uint64_t target) {
    std::atomic<uint64_t>& w = c_.word(peer, t, phase);
    if (w.load(std::memory_order_acquire) >= target) return true;
    if (c_.failed.load()) return PeerFailed(peer, t, phase, chunk);
    std::this_thread::yield();  // give the peer a chance before sleeping
    if (w.load(std::memory_order_acquire) >= target) return true;
    Slot& s = c_.slots[peer];
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::milliseconds(timeout_);
    bool reached;
    {
      std::unique_lock<std::mutex> lk(s.mu);
      ++s.waiters;
      reached = s.cv.wait_until(lk, deadline, [&] {
        return w.load(std::memory_order_acquire) >= target || c_.failed.load();
      });
      --s.waiters;
    }
    if (c_.failed.load()) return PeerFailed(peer, t, phase, chunk);
    if (reached) return true;
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.1f",
                  std::chrono::duration<double>(Clock::now() - start).count());
    error_ = Who() + " waited " + secs + " s for rank " + std::to_string(peer) + " in tree " +
             std::to_string(t) + " chunk " + std::to_string(chunk) + " (" + PhaseName(phase) +
             "), " + CallName() + ". A rank did not join this collective (skipped under "
             "lax.cond?) or a peer failed. The collective's state is reset: every rank's call of "
             "it fails fast until all " + std::to_string(c_.nranks) +
             " ranks have seen the failure, then it starts afresh (or call "
             "jax_blink._blink_cpu.reset() when nothing runs).";
    code_ = ffi::ErrorCode::kDeadlineExceeded;
    {
      std::lock_guard<std::mutex> g(c_.mu);
      c_.FailLocked(error_);
    }
    c_.WakeAll();
    return false;
  }

  // Brackets copies from peers' `out`: a failing peer waits for its readers before it returns.
  bool BeginRead(const int32_t* peers, int n) {
    for (int i = 0; i < n; ++i) c_.slots[peers[i]].readers.fetch_add(1);
    if (c_.failed.load()) {
      EndRead(peers, n);
      return PeerFailed(peers[0], -1, 0, -1);
    }
    return true;
  }
  void EndRead(const int32_t* peers, int n) {
    for (int i = 0; i < n; ++i) c_.slots[peers[i]].readers.fetch_sub(1, std::memory_order_release);
  }

  // Stores this rank's progress word and wakes whoever waits on this rank.
  void Publish(int t, int phase, uint64_t value) {
    Slot& s = c_.slots[rank_];
    bool notify;
    {
      std::lock_guard<std::mutex> g(s.mu);
      c_.word(rank_, t, phase).store(value, std::memory_order_release);
      notify = s.waiters > 0;
    }
    if (notify) s.cv.notify_all();
  }

 private:
  static const char* PhaseName(int phase) { return phase == kReduce ? "reduce" : "broadcast"; }

  bool PeerFailed(int peer, int t, int phase, int64_t chunk) {
    std::string failure;
    {
      std::lock_guard<std::mutex> g(c_.mu);
      failure = c_.failure;
    }
    error_ = Who() + ": " + CallName() + " failed while this rank ";
    if (t >= 0)
      error_ += "waited for rank " + std::to_string(peer) + " in tree " + std::to_string(t) +
                " chunk " + std::to_string(chunk) + " (" + PhaseName(phase) + ")";
    else
      error_ += "read from rank " + std::to_string(peer);
    error_ += ". First failure: " + failure;
    code_ = ffi::ErrorCode::kAborted;
    return false;
  }

  Comm& c_;
  const int rank_, device_;
  const uint64_t seq_;
  const int64_t timeout_;
  std::string error_;
  ffi::ErrorCode code_ = ffi::ErrorCode::kOk;
};

ffi::Error Fail(ffi::ErrorCode code, std::string msg) { return ffi::Error(code, std::move(msg)); }

// Runs the schedule for one rank (the caller has entered the communicator).
bool RunSchedule(Comm& c, Call& call, int rank, uint64_t seq, ReduceFn reduce, size_t esize,
                 const char* in, char* out) {
  const Program& p = c.program;
  const int64_t ce = p.chunk_elems();
  const uint64_t base = seq << 32;
  const bool alias = in == out;
  if (!alias)
    for (const auto& [off, len] : c.gaps) std::memcpy(out + off * esize, in + off * esize, len * esize);

  thread_local std::vector<const void*> kid_ptrs;
  if (kid_ptrs.size() < static_cast<size_t>(c.nranks)) kid_ptrs.resize(c.nranks);

  for (int t = 0; t < c.ntrees; ++t) {
    const TreeView& tv = p.tree(t);
    const int64_t nch = tv.num_chunks(ce);
    if (nch == 0) continue;
    const size_t ci = static_cast<size_t>(t) * c.nranks + rank;
    const int32_t* kids = c.child_list.data() + c.child_begin[ci];
    const int nk = c.child_begin[ci + 1] - c.child_begin[ci];
    const bool root = tv.root == rank;
    const int parent = tv.parent[rank];
    const int64_t seg_end = tv.seg_offset + tv.seg_len;

    if (tv.phases & kPhaseReduce) {
      for (int64_t ch = 0; ch < nch; ++ch) {
        const int64_t off = tv.seg_offset + ch * ce, n = std::min(ce, seg_end - off);
        for (int k = 0; k < nk; ++k)
          if (!call.Wait(kids[k], t, kReduce, ch, base | (ch + 1))) return false;
        if (nk == 0) {
          if (!alias) std::memcpy(out + off * esize, in + off * esize, n * esize);
        } else {
          for (int k = 0; k < nk; ++k)
            kid_ptrs[k] = static_cast<const char*>(c.slots[kids[k]].out.load(std::memory_order_relaxed)) +
                          off * esize;
          if (!call.BeginRead(kids, nk)) return false;
          reduce(out + off * esize, in + off * esize, kid_ptrs.data(), nk, n);
          call.EndRead(kids, nk);
        }
        call.Publish(t, kReduce, base | (ch + 1));
        if (root && (tv.phases & kPhaseBroadcast)) call.Publish(t, kBroadcast, base | (ch + 1));
      }
    }
    if (tv.phases & kPhaseBroadcast) {
      if (root) {
        if (!(tv.phases & kPhaseReduce)) {
          if (alias) {
            call.Publish(t, kBroadcast, base | nch);
          } else {
            for (int64_t ch = 0; ch < nch; ++ch) {
              const int64_t off = tv.seg_offset + ch * ce, n = std::min(ce, seg_end - off);
              std::memcpy(out + off * esize, in + off * esize, n * esize);
              call.Publish(t, kBroadcast, base | (ch + 1));
            }
          }
        }
      } else {
        const int32_t par[1] = {parent};
        for (int64_t ch = 0; ch < nch; ++ch) {
          const int64_t off = tv.seg_offset + ch * ce, n = std::min(ce, seg_end - off);
          if (!call.Wait(parent, t, kBroadcast, ch, base | (ch + 1))) return false;
          const char* src = static_cast<const char*>(c.slots[parent].out.load(std::memory_order_relaxed));
          if (!call.BeginRead(par, 1)) return false;
          std::memcpy(out + off * esize, src + off * esize, n * esize);
          call.EndRead(par, 1);
          call.Publish(t, kBroadcast, base | (ch + 1));
        }
      }
    }
  }
  // Exit: nobody may still read this rank's `out`.
  for (int t = 0; t < c.ntrees; ++t) {
    const TreeView& tv = p.tree(t);
    const int64_t nch = tv.num_chunks(ce);
    if (nch == 0) continue;
    if (tv.phases & kPhaseBroadcast) {
      const size_t ci = static_cast<size_t>(t) * c.nranks + rank;
      for (int32_t i = c.child_begin[ci]; i < c.child_begin[ci + 1]; ++i)
        if (!call.Wait(c.child_list[i], t, kBroadcast, nch - 1, base | nch)) return false;
    } else if (tv.root != rank) {
      if (!call.Wait(tv.parent[rank], t, kReduce, nch - 1, base | nch)) return false;
    }
  }
  return true;
}

ffi::Error Execute(int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                   ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Span<const int32_t> program, int32_t op, int64_t comm_id,
                   int64_t timeout_ms) {
  const ffi::DataType dtype = x.element_type();
  auto dev = [&] {  // error messages only: no allocation on the good path
    return "jax_blink (host device " + std::to_string(device) + ", collective " +
           std::to_string(comm_id) + "): ";
  };
  if (op < 0 || op > 2)
    return Fail(ffi::ErrorCode::kInvalidArgument,
                dev() + "op " + std::to_string(op) + " is not supported; supported: 0 (sum), 1 (max), 2 (min)");
  const ReduceFn reduce = PickReduce(dtype, op);
  if (reduce == nullptr)
    return Fail(ffi::ErrorCode::kInvalidArgument,
                dev() + "dtype " + DtypeName(dtype) +
                    " is not supported; supported: float32, float64, bfloat16, float16, int32, int64");
  if (out->element_type() != dtype || out->element_count() != x.element_count())
    return Fail(ffi::ErrorCode::kInvalidArgument, dev() + "the result must have the operand's shape and dtype");
  if (rank_buf.element_count() != 1 || group_buf.element_count() != 1)
    return Fail(ffi::ErrorCode::kInvalidArgument, dev() + "rank and group must be int32 scalars");
  if (timeout_ms <= 0) timeout_ms = kDefaultTimeoutMs;
  const int rank = rank_buf.typed_data()[0];
  const int32_t group = group_buf.typed_data()[0];

  std::shared_ptr<Comm> comm_ptr = GetComm(comm_id, group);
  Comm& c = *comm_ptr;
  uint64_t seq;
  {
    std::unique_lock<std::mutex> lk(c.mu);
    auto who = [&] {
      return "jax_blink: rank " + std::to_string(rank) + " (host device " + std::to_string(device) +
             ", group " + std::to_string(group) + ") of collective " + std::to_string(comm_id) + ": ";
    };
    if (!c.configured) {
      std::string err = c.Configure(program.begin(), static_cast<int64_t>(program.size()), dtype, op);
      if (!err.empty()) return Fail(ffi::ErrorCode::kInvalidArgument, who() + "bad schedule program: " + err);
    }
    std::string mismatch;
    if (program.size() != c.words.size() ||
        !std::equal(program.begin(), program.end(), c.words.begin()))
      mismatch = "its schedule program differs from the one its peers run (" +
                 std::to_string(program.size()) + " words against " + std::to_string(c.words.size()) + ")";
    else if (dtype != c.dtype)
      mismatch = std::string("dtype ") + DtypeName(dtype) + " differs from its peers' " + DtypeName(c.dtype);
    else if (op != c.op)
      mismatch = std::string("op ") + OpName(op) + " differs from its peers' " + OpName(c.op);
    else if (static_cast<int64_t>(x.element_count()) != c.program.total_elems())
      mismatch = "the operand has " + std::to_string(x.element_count()) + " elements, the program " +
                 std::to_string(c.program.total_elems());
    else if (rank < 0 || rank >= c.nranks)
      mismatch = "rank " + std::to_string(rank) + " is outside the program's " + std::to_string(c.nranks) + " ranks";
    else if (c.slots[rank].in_call)
      mismatch = "another call (host device " + std::to_string(c.slots[rank].device) +
                 ") is running as the same rank";
    if (!mismatch.empty()) {
      std::string msg = who() + mismatch + ". Every rank of a collective must run the same call. "
                              "The collective is failed for all its ranks.";
      c.FailLocked(msg);
      c.AckLocked(rank);
      c.WakeAll();  // under c.mu (lock order: Comm::mu, then Slot::mu), before a reset frees slots
      c.MaybeResetLocked();
      return Fail(ffi::ErrorCode::kInvalidArgument, msg);
    }
    Slot& s = c.slots[rank];
    if (c.failed.load()) {
      c.AckLocked(rank);
      std::string msg = who() + "this call is dropped because the collective failed earlier; it runs "
                              "again once all " + std::to_string(c.nranks) +
                        " ranks have seen the failure (" + std::to_string(c.nacked) +
                        " have). First failure: " + c.failure;
      c.MaybeResetLocked();
      return Fail(ffi::ErrorCode::kAborted, msg);
    }
    s.in_call = true;
    s.device = device;
    seq = ++s.seq;
    s.in.store(x.untyped_data(), std::memory_order_relaxed);
    s.out.store(out->untyped_data(), std::memory_order_relaxed);
    ++c.in_flight;
  }

  Call call(c, rank, device, seq, timeout_ms);
  bool ok = RunSchedule(c, call, rank, seq, reduce, ffi::ByteWidth(dtype),
                        static_cast<const char*>(x.untyped_data()), static_cast<char*>(out->untyped_data()));
  std::string error = call.error();
  ffi::ErrorCode code = call.code();
  if (!ok) {
    // Peers may be in the middle of copying from our buffers: they saw no failure when they
    // started, and they finish without waiting on anything.
    std::atomic<int>& readers = c.slots[rank].readers;
    while (readers.load() != 0) std::this_thread::yield();
  }
  {
    std::lock_guard<std::mutex> g(c.mu);
    c.slots[rank].in_call = false;
    --c.in_flight;
    if (c.failed.load()) {
      if (ok) {
        ok = false;
        error = call.Who() + ": " + call.CallName() + " finished here but the collective failed: " + c.failure;
        code = ffi::ErrorCode::kAborted;
      }
      c.AckLocked(rank);
      c.MaybeResetLocked();
    }
  }
  if (!ok) return Fail(code, error);
  return ffi::Error::Success();
}

}  // namespace

std::string ResetAll() {
  std::lock_guard<std::mutex> g(g_mu);
  for (auto& [key, comm] : g_comms) {
    std::lock_guard<std::mutex> cg(comm->mu);
    if (comm->in_flight != 0)
      return "jax_blink: cannot reset while a call of collective " + std::to_string(key.first) +
             " (group " + std::to_string(key.second) + ") is running";
  }
  g_comms.clear();
  g_generation.fetch_add(1, std::memory_order_acq_rel);
  return {};
}

size_t NumComms() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_comms.size();
}

CommStatus Status(int64_t comm_id, int32_t group) {
  std::shared_ptr<Comm> comm;
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_comms.find({comm_id, group});
    if (it == g_comms.end()) return {};
    comm = it->second;
  }
  std::lock_guard<std::mutex> g(comm->mu);
  CommStatus s;
  s.exists = true;
  s.configured = comm->configured;
  s.failed = comm->failed.load();
  s.nranks = comm->nranks;
  s.in_flight = comm->in_flight;
  s.acked = comm->nacked;
  s.failure = comm->failure;
  if (comm->slots)
    for (int r = 0; r < comm->nranks; ++r)
      s.seqs += (r ? "," : "") + std::to_string(comm->slots[r].seq);
  return s;
}

const char* Version() { return "jax_blink CPU executor 0.1.0 (program format v1)"; }

}  // namespace jax_blink::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkCollectiveCpu, jax_blink::cpu::Execute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<xla::ffi::Span<const int32_t>>("program")
                                  .Attr<int32_t>("op")
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int64_t>("timeout_ms"));
