// CPU back end of "jax_blink_collective": see cpu/executor.h and common/program.h.
//
// ## Shape of the executor
// XLA's CPU client runs each host device's program on its own thread and nothing orders the
// launches of different devices. Every call of the custom call looks up the communicator of its
// (comm_id, group): comm_id names the lowered call site, group the slice of the other mesh axes.
// Calls of one communicator are matched across ranks by (RunId, k): ffi::RunId is shared by every
// device of one launch and differs between launches, and k counts this rank's calls of the comm
// in that launch (a loop calls one call site many times). The first rank to arrive at a call gives
// it a comm-wide number g. A communicator holds, per rank, a slot (this call's in/out pointers, a
// `done` word) and per tree two progress words, reduce and broadcast, each (g << 32 | chunks
// done). A rank publishes a word only once the data it stands for is in place (in its `out`, or
// its `in`); a waiter needs the high half to equal its own g, so words of another call never
// satisfy it. Peers read those buffers directly (one process, host pointers are shared), as GPUs
// read a peer's buffer under peer access. The walk itself, and which buffers whom, is shared with
// the shared-memory executor: RunSteps in cpu/schedule_walk.h.
//
// Waits sleep on the watched rank's mutex and condition variable (no busy spinning: up to 32 host
// devices share 2 cores); a publisher stores its word without a lock and takes the mutex to notify
// only when somebody sleeps (Call::Publish). Every wait has its own deadline of timeout_ms.
//
// ## Order, and why it cannot deadlock
// Every rank runs the same steps in the same order: trees in program order, in each tree all reduce
// chunks, then all broadcast chunks; then its exit waits. Name a step by its key (t, phase, c),
// ordered lexicographically with reduce < broadcast. A reduce step (r, t, R, c) waits only for the
// children of r to finish their step (t, R, c) (a leaf finishes all of them at entry); a
// broadcast step (r, t, B, c) waits only for the root of t to finish (t, B, c), which the root
// does within its step (t, R, c), or at entry in a broadcast-only tree: an earlier key, so these
// waits never block a chain of ranks (read "parent" as "root" below, a chain of length one). Exit
// waits come after a rank's last step and wait for peers to finish all theirs (`done`): once no
// step waits forever, they end too.
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
// buffers any more: each rank publishes `done` after its last read of a peer, and waits for the
// `done` of every peer that reads its own (ScheduleLayout::readers_of: the parents in trees with a
// reduce phase, every rank in trees it roots with a broadcast phase). `in` may alias `out` (donation):
// each element of `out` is written from `in`, the children or the root at the same index only,
// and only after the peers that read that element of `in` have read it (RunSteps).
//
// ## Faults: deadlines, failure, and getting back to work
// A wait past its deadline marks its call (the CallRec of (RunId, k)) failed, keeping the first
// message, wakes every waiter of the communicator, and returns DEADLINE_EXCEEDED naming the rank,
// device, group, the awaited rank, tree, chunk, phase, call and comm_id, and the ranks that never
// joined the call. Waiters of that call wake and return ABORTED quoting it; a rank that arrives at
// the failed call later (a slow rank) fails at once. A failing rank first waits until no peer is
// in the middle of copying from its buffers (each copy brackets itself with a per-slot reader count
// and re-checks the failure flag, Dekker-style), so a peer never reads memory XLA has reused.
// A program, dtype, op or size that differs from its peers' fails the call the same way
// (INVALID_ARGUMENT), so the others fail fast instead of waiting out their deadline.
// Nothing else needs resetting: the failure belongs to one call of one launch. Other comm_ids are
// other communicators; the next launch has a new RunId, so its calls start afresh on every rank
// and line up whatever the failed launch left behind (a rank skipped under lax.cond: each launch
// times out on the others while it keeps skipping, and works as soon as it takes part). Calls that
// some rank never joins stay in the table until it grows past a bound, then are evicted oldest
// first (a rank arriving for an evicted call waits for peers that are gone: a timeout, never a
// hang). `_blink_cpu.reset()` drops every communicator when nothing runs.
// Why RunId, against per-rank call counters (the first design): after a rank skipped a call its
// counter stays one behind for ever, and no reset protocol can tell a skipped call from a late one
// without knowing the launch, so counters either pair calls of different launches (silently wrong
// under async dispatch) or need every rank to take part in a reset. Within one launch calls still
// pair by count: a rank that skips call 1 of a loop but makes call 2 pairs it with the others'
// call 1; their last call then times out, so that launch fails rather than returning.
//
// ## Binding
// The brief's binding plus .Ctx<ffi::RunId>() after DeviceOrdinal: contexts are not operands or
// attributes, so the Python lowering and the CUDA back end's call are unchanged.

#include "cpu/executor.h"

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

#include "common/ffi_binding.h"
#include "common/program.h"
#include "cpu/reduce.h"
#include "cpu/schedule_walk.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_blink::cpu {
namespace {

using namespace jax_blink::cpu_reduce;  // NOLINT: the element code shared with cpu/shm.cc

using Clock = std::chrono::steady_clock;
constexpr int64_t kDefaultTimeoutMs = 10000;
using cpu_walk::kBroadcast;
using cpu_walk::kReduce;
constexpr int kDone = -2;  // Call::Wait's tree for a peer's `done` word

// ---------------------------------------------------------------------------------------------
// Element types and the combining ops: kernels/cpu/reduce.h (shared with cpu/shm.cc).

// ---------------------------------------------------------------------------------------------
// Communicator state.

// One call of a communicator, as every rank of it sees it: the k-th call of the comm in launch
// `run_id` (ffi::RunId is shared by all devices of one launch). It lives in Comm::calls from the
// first rank's arrival until every rank has been through it (or it is evicted, see Comm::Evict).
struct CallRec {
  uint32_t g = 0;               // comm-wide number of this call: the high half of progress words
  int arrived = 0;              // ranks that entered it
  int left = 0;                 // ranks that returned from it
  std::atomic<bool> failed{false};
  std::string failure;          // first failure's message, under Comm::mu
};

struct Slot {
  // Guards sleeping on the condition variable (a publisher takes it only when somebody sleeps).
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<int> waiters{0};            // peers sleeping (or about to) on cv; changed under mu
  std::atomic<const void*> in{nullptr};   // this call's buffers (stored at entry, before any
  std::atomic<void*> out{nullptr};        // progress word of the call: its acquire publishes them)
  std::atomic<int> readers{0};            // peers copying from its buffers right now
  std::atomic<uint64_t> done{0};          // (g << 32 | 1) once this rank read all it reads in call g
  // Under Comm::mu:
  int64_t run_id = 0;     // launch of the current (or last) call
  uint32_t k = 0;         // calls of this comm in that launch so far
  uint32_t g = 0;         // CallRec::g of the current (or last) call; 0 = none yet
  uint64_t calls = 0;     // calls since the communicator was made (statistics)
  bool in_call = false;
  int device = -1;
};

struct Comm {
  Comm(int64_t id, int32_t grp) : comm_id(id), group(grp) {}
  const int64_t comm_id;
  const int32_t group;

  std::mutex mu;
  // Configuration: written once, by the first call, under mu; read freely afterwards.
  bool configured = false;
  std::vector<int32_t> words;  // the program, as the first rank brought it
  Program program;             // decoded over `words`
  ffi::DataType dtype = ffi::DataType::INVALID;
  int32_t op = 0;
  int nranks = 0, ntrees = 0;
  cpu_walk::ScheduleLayout layout;  // children, gaps, who reads whose buffers
  std::unique_ptr<Slot[]> slots;
  std::unique_ptr<std::atomic<uint64_t>[]> progress;  // [(r * ntrees + t) * 2 + phase]

  // Under mu.
  std::map<std::pair<int64_t, uint32_t>, CallRec> calls;  // (run_id, k) -> call
  uint32_t next_g = 0;
  int in_flight = 0;
  uint64_t failures = 0;
  uint64_t in_place_calls = 0;  // calls whose operand aliased the result (donation)


  std::atomic<uint64_t>& word(int r, int t, int phase) {
    return progress[(static_cast<size_t>(r) * ntrees + t) * 2 + phase];
  }

  // Under mu, once.
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
    layout.Build(program);
    slots.reset(new Slot[nranks]);
    const size_t nwords = static_cast<size_t>(nranks) * ntrees * 2;
    progress.reset(new std::atomic<uint64_t>[nwords]);
    for (size_t i = 0; i < nwords; ++i) progress[i].store(0);
    configured = true;
    return {};
  }

  // Under mu. Marks `rec` failed (the first message wins) and wakes every waiter of this comm
  // (lock order: Comm::mu, then Slot::mu; nobody takes them the other way round).
  void FailLocked(CallRec& rec, const std::string& msg) {
    if (!rec.failed.load()) {
      rec.failure = msg;
      rec.failed.store(true);
      ++failures;
    }
    for (int r = 0; r < nranks; ++r) {
      std::lock_guard<std::mutex> g(slots[r].mu);
      slots[r].cv.notify_all();
    }
  }

  // Under mu. A call leaves the table once every rank has been through it; calls that some rank
  // never joins (it skipped them, or its launch failed first) are evicted oldest first, once
  // nobody is inside, when the table grows past kMaxCalls. A rank arriving for an evicted call
  // starts it afresh and times out waiting for its peers: an error, never a hang.
  void LeaveLocked(std::map<std::pair<int64_t, uint32_t>, CallRec>::iterator it) {
    if (++it->second.left >= nranks) {
      calls.erase(it);
      return;
    }
    const size_t max_calls = std::max<size_t>(64, 4 * static_cast<size_t>(nranks));
    while (calls.size() > max_calls) {
      auto victim = calls.end();
      for (auto j = calls.begin(); j != calls.end(); ++j)
        if (j->second.arrived == j->second.left &&
            (victim == calls.end() || j->second.g - victim->second.g > 0x80000000u))
          victim = j;
      if (victim == calls.end()) break;
      calls.erase(victim);
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
  Call(Comm& comm, CallRec& rec, int rank, int device, uint32_t k, int64_t timeout_ms)
      : c_(comm), rec_(rec), rank_(rank), device_(device), k_(k), g_(rec.g), timeout_(timeout_ms) {}

  const std::string& error() const { return error_; }
  ffi::ErrorCode code() const { return code_; }
  uint64_t base() const { return static_cast<uint64_t>(g_) << 32; }

  std::string Who() const {
    return "jax_blink: rank " + std::to_string(rank_) + " (host device " + std::to_string(device_) +
           ", group " + std::to_string(c_.group) + ")";
  }
  std::string CallName() const {
    return "call #" + std::to_string(k_) + " of collective " + std::to_string(c_.comm_id) +
           " in this launch";
  }

  // Waits until `peer` has finished chunk `chunk` of (t, phase) in this call.
  // t == kDone: until `peer` has read everything it reads in this call (chunk 0, phase unused).
  bool Wait(int peer, int t, int phase, int64_t chunk) {
    std::atomic<uint64_t>& w = t == kDone ? c_.slots[peer].done : c_.word(peer, t, phase);
    const uint64_t target = base() | static_cast<uint64_t>(chunk + 1);
    auto reached = [&] {
      const uint64_t v = w.load(std::memory_order_seq_cst);  // seq_cst: see Publish
      return (v >> 32) == g_ && v >= target;
    };
    if (reached()) return true;
    if (rec_.failed.load()) return PeerFailed(peer, t, phase, chunk);
    std::this_thread::yield();  // give the peer a chance before sleeping
    if (reached()) return true;
    Slot& s = c_.slots[peer];
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::milliseconds(timeout_);
    bool ok;
    {
      std::unique_lock<std::mutex> lk(s.mu);
      s.waiters.fetch_add(1, std::memory_order_seq_cst);
      ok = s.cv.wait_until(lk, deadline, [&] { return reached() || rec_.failed.load(); });
      s.waiters.fetch_sub(1, std::memory_order_relaxed);
    }
    if (rec_.failed.load()) return PeerFailed(peer, t, phase, chunk);
    if (ok) return true;
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.1f",
                  std::chrono::duration<double>(Clock::now() - start).count());
    error_ = Who() + " waited " + secs + " s for rank " + std::to_string(peer) +
             (t == kDone ? std::string(" to finish reading this rank's buffers")
                         : " in tree " + std::to_string(t) + " chunk " + std::to_string(chunk) + " (" +
                               PhaseName(phase) + ")") +
             ", " + CallName() + ". A rank did not join this collective (skipped under "
             "lax.cond?) or a peer failed. ";
    code_ = ffi::ErrorCode::kDeadlineExceeded;
    std::lock_guard<std::mutex> g(c_.mu);
    std::string absent;
    for (int r = 0; r < c_.nranks; ++r)
      if (c_.slots[r].g != g_) absent += (absent.empty() ? "" : ", ") + std::to_string(r);
    error_ += absent.empty() ? "Every rank joined this call (a peer failed or is stuck). "
                             : "Ranks that never joined this call: " + absent + ". ";
    error_ += "This call fails on every rank (a late rank fails fast); the collective's state is "
              "reset for the next launch, which starts afresh.";
    c_.FailLocked(rec_, error_);
    return false;
  }

  // This rank has read everything it reads in this call.
  void PublishDone() {
    Slot& s = c_.slots[rank_];
    s.done.store(base() | 1u, std::memory_order_seq_cst);
    if (s.waiters.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> g(s.mu); }
      s.cv.notify_all();
    }
  }

  // cpu_walk's policy: one process, so peers read this rank's operand where XLA put it.
  static constexpr bool kOperandShared = true;
  // A peer's reduce result: a leaf's is its operand, any other rank's its `out`.
  const char* Value(int peer, int /*t*/, bool leaf) const {
    const Slot& s = c_.slots[peer];
    return static_cast<const char*>(leaf ? s.in.load(std::memory_order_relaxed) : s.out.load(std::memory_order_relaxed));
  }
  // A tree's final value: the root's `out` after a reduce phase, else its operand.
  const char* RootValue(int root, bool reduced) const { return Value(root, -1, !reduced); }
  bool WaitDone(int peer) { return Wait(peer, kDone, 0, 0); }

  // Chunks of (t, phase) that `peer` has finished in this call (after a successful Wait on it).
  uint64_t Progress(int peer, int t, int phase) const {
    const uint64_t v = c_.word(peer, t, phase).load(std::memory_order_acquire);
    return (v >> 32) == g_ ? (v & 0xffffffffu) : 0;
  }

  // Brackets copies from peers' buffers: a failing peer waits for its readers before it returns.
  bool BeginRead(const int32_t* peers, int n) {
    for (int i = 0; i < n; ++i) c_.slots[peers[i]].readers.fetch_add(1);
    if (rec_.failed.load()) {
      EndRead(peers, n);
      return PeerFailed(peers[0], -1, 0, -1);
    }
    return true;
  }
  void EndRead(const int32_t* peers, int n) {
    for (int i = 0; i < n; ++i) c_.slots[peers[i]].readers.fetch_sub(1, std::memory_order_release);
  }

  // Stores this rank's progress word: chunks [0, chunks) of (t, phase) are done. No lock unless a
  // peer sleeps: the word's store and the load of `waiters` are sequentially consistent, as are a
  // waiter's increment and its load of the word, so either this publisher sees the waiter (and
  // takes the mutex, which the waiter holds from its check until it sleeps, then notifies) or the
  // waiter sees the word.
  void Publish(int t, int phase, int64_t chunks) {
    Slot& s = c_.slots[rank_];
    c_.word(rank_, t, phase).store(base() | static_cast<uint64_t>(chunks), std::memory_order_seq_cst);
    if (s.waiters.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> g(s.mu); }
      s.cv.notify_all();
    }
  }

 private:
  static const char* PhaseName(int phase) { return phase == kReduce ? "reduce" : "broadcast"; }

  bool PeerFailed(int peer, int t, int phase, int64_t chunk) {
    std::string failure;
    {
      std::lock_guard<std::mutex> g(c_.mu);
      failure = rec_.failure;
    }
    error_ = Who() + ": " + CallName() + " failed while this rank ";
    if (t == kDone)
      error_ += "waited for rank " + std::to_string(peer) + " to finish reading its buffers";
    else if (t >= 0)
      error_ += "waited for rank " + std::to_string(peer) + " in tree " + std::to_string(t) +
                " chunk " + std::to_string(chunk) + " (" + PhaseName(phase) + ")";
    else
      error_ += "read from rank " + std::to_string(peer);
    error_ += ". First failure: " + failure;
    code_ = ffi::ErrorCode::kAborted;
    return false;
  }

  Comm& c_;
  CallRec& rec_;
  const int rank_, device_;
  const uint32_t k_, g_;
  const int64_t timeout_;
  std::string error_;
  ffi::ErrorCode code_ = ffi::ErrorCode::kOk;
};

ffi::Error Fail(ffi::ErrorCode code, std::string msg) { return ffi::Error(code, std::move(msg)); }

ffi::Error Execute(int32_t device, ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                   ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Span<const int32_t> program, int32_t op, int64_t comm_id,
                   int64_t timeout_ms, float /*host_share*/) {
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
  std::map<std::pair<int64_t, uint32_t>, CallRec>::iterator it;
  uint32_t k;
  {
    std::lock_guard<std::mutex> lk(c.mu);
    auto who = [&] {
      return "jax_blink: rank " + std::to_string(rank) + " (host device " + std::to_string(device) +
             ", group " + std::to_string(group) + ") of collective " + std::to_string(comm_id) + ": ";
    };
    if (!c.configured) {
      std::string err = c.Configure(program.begin(), static_cast<int64_t>(program.size()), dtype, op);
      if (!err.empty()) return Fail(ffi::ErrorCode::kInvalidArgument, who() + "bad schedule program: " + err);
    }
    if (rank < 0 || rank >= c.nranks)
      return Fail(ffi::ErrorCode::kInvalidArgument,
                  who() + "rank " + std::to_string(rank) + " is outside the program's " +
                      std::to_string(c.nranks) + " ranks (the mesh axis and the program disagree)");
    Slot& s = c.slots[rank];
    if (s.in_call)
      return Fail(ffi::ErrorCode::kInvalidArgument,
                  who() + "another call (host device " + std::to_string(s.device) +
                      ") is running as the same rank of the same group");
    if (s.run_id != run.run_id || s.g == 0) {
      s.run_id = run.run_id;
      s.k = 0;
    }
    k = ++s.k;
    it = c.calls.find({run.run_id, k});
    if (it == c.calls.end()) {
      it = c.calls.try_emplace({run.run_id, k}).first;
      if (++c.next_g == 0) ++c.next_g;  // 0 means "no call yet"
      it->second.g = c.next_g;
    }
    CallRec& rec = it->second;
    ++rec.arrived;
    s.g = rec.g;
    ++s.calls;
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
    if (!mismatch.empty()) {
      std::string msg = who() + mismatch + ". Every rank of a collective must run the same call; "
                                "this call fails on every rank.";
      c.FailLocked(rec, msg);
      c.LeaveLocked(it);
      return Fail(ffi::ErrorCode::kInvalidArgument, msg);
    }
    if (rec.failed.load()) {
      std::string msg = who() + "call #" + std::to_string(k) +
                        " of this launch already failed on its peers; it fails here at once. "
                        "First failure: " + rec.failure;
      c.LeaveLocked(it);
      return Fail(ffi::ErrorCode::kAborted, msg);
    }
    s.in_call = true;
    s.device = device;
    s.in.store(x.untyped_data(), std::memory_order_relaxed);
    s.out.store(out->untyped_data(), std::memory_order_relaxed);
    ++c.in_flight;
    if (x.untyped_data() == out->untyped_data()) ++c.in_place_calls;
  }

  CallRec& rec = it->second;
  Call call(c, rec, rank, device, k, timeout_ms);
  // The schedule (cpu/schedule_walk.h), its result in `out`; peers read this rank's `in` and `out`.
  bool ok = cpu_walk::RunSteps(c.program, c.layout, call, rank, reduce, ffi::ByteWidth(dtype),
                               static_cast<const char*>(x.untyped_data()), static_cast<char*>(out->untyped_data())) &&
            cpu_walk::WaitForReaders(c.program, c.layout, call, rank);
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
    if (ok && rec.failed.load()) {
      ok = false;
      error = call.Who() + ": " + call.CallName() + " finished here, but failed on a peer: " + rec.failure;
      code = ffi::ErrorCode::kAborted;
    }
    c.LeaveLocked(it);
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
  s.nranks = comm->nranks;
  s.in_flight = comm->in_flight;
  s.failures = comm->failures;
  s.in_place_calls = comm->in_place_calls;
  for (const auto& [key, rec] : comm->calls) {
    ++s.open_calls;
    if (rec.failed.load()) ++s.failed_calls;
  }
  if (comm->slots)
    for (int r = 0; r < comm->nranks; ++r) s.calls.push_back(comm->slots[r].calls);
  return s;
}

const char* Version() { return "jax_blink CPU executor 0.1.0 (program format v1)"; }

}  // namespace jax_blink::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkCollectiveCpu, jax_blink::cpu::Execute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::RunId>() JAX_BLINK_OPERANDS JAX_BLINK_CALL_ATTRS);
