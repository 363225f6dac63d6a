// CPU back end of "jax_blink_collective_mp": a collective whose ranks live in several processes
// of one machine. See cpu/shm.h; the schedule's semantics are common/program.h's.
//
// ## The segment
// One POSIX shared-memory segment per communicator (comm_id, group), named
// /jxb_<job key>_<comm_id>_<group>: the job key comes from the job's key-value store
// (jax_blink/distributed.py), so a segment of another job, or of a crashed earlier job, is never
// opened. Layout: a header (magic, the program's hash, dtype, op, sizes, the number of ranks
// attached, the first failure), one record per rank (attached, process, pid, device, futex epoch,
// waiters, calls done), the progress words (nranks x ntrees x 2, as in
// cpu/executor.cc) and one staging area per rank (the operand's size). Every rank computes its
// result in its own staging area, peers read it there, and the rank copies it to XLA's result
// buffer at the end. The walk is the in-process executor's (cpu/schedule_walk.h) with the staging
// area as a rank's own buffer: a leaf copies its operand there first, a broadcast reads the root's.
//
// ## Set-up (a rank's first call)
// The first rank to arrive creates the segment (O_CREAT | O_EXCL, mode 0600), sizes it, fills the
// header and publishes the magic word last; the others open it, wait for the magic and compare the
// header with their own call (a different program, dtype or op fails the set-up). Each rank marks
// itself attached; the rank that completes the count unlinks the name, so nothing stays in
// /dev/shm once the set-up is done (the memory lives until the last process unmaps it or exits).
// Every rank then waits until all ranks are attached, within the set-up budget (processes reach
// their first call at different times: JAX_BLINK_SETUP_TIMEOUT_S, default 60 s); past it, it
// records a failure naming the ranks (and, from the mesh at lowering time, their processes and
// devices) that never attached, unlinks the name itself and fails.
//
// ## A call
// Calls of one communicator pair by their number g on each rank (RunId is per process, so it
// cannot pair calls across processes): rank r's g-th call meets its peers' g-th call. Progress
// words are (g << 32 | chunks done), stored with release after the chunk is in the staging area;
// a waiter needs the high half to equal its own g. The same steps as cpu/executor.cc, one walk
// (trees in order; per tree all reduce chunks, then all broadcast chunks; then the exit waits), so
// the same argument rules out deadlock, and a rank starts its next call (overwriting its staging
// area) only after every peer that reads it has finished reading. Waits sleep on a futex (the
// watched rank's epoch word, process-shared), in slices, so that a waiter notices a peer whose
// process has exited before its budget runs out.
//
// ## Faults
// A failure (a wait past its budget, a peer process gone, a mismatched call) is recorded once in
// the header and wakes every waiter; from then on every call of that communicator fails at once
// quoting it: the ranks' call numbers no longer line up, so a failed communicator stays failed
// (the job restarts, as it would after an NCCL error).

#include "cpu/shm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/ffi_binding.h"
#include "common/program.h"
#include "cpu/reduce.h"
#include "cpu/schedule_walk.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_blink::shm {
namespace {

using namespace jax_blink::cpu_reduce;  // NOLINT: the element code shared with cpu/executor.cc
using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x314b4e494c42584aULL;  // "JXBLINK1"
constexpr uint32_t kLayoutVersion = 2;
constexpr int64_t kDefaultTimeoutMs = 10000;
using cpu_walk::kBroadcast;
using cpu_walk::kReduce;
constexpr size_t kAlign = 64;
constexpr int64_t kSliceMs = 100;  // longest sleep between checks that the watched peer lives
constexpr const char* kSameCollectives =
    ": the processes run different collectives under one call-site id (every process must trace the "
    "same collectives, with the same shapes, in the same order)";

struct alignas(kAlign) Header {
  std::atomic<uint64_t> magic;  // stored last by the creator
  uint32_t version;
  int32_t nranks, ntrees, dtype, op;
  int64_t total_elems, esize;
  uint64_t program_hash;
  uint64_t size;
  int32_t creator_process;        // jax.process_index() of the process that created the segment
  std::atomic<int32_t> attached;  // ranks attached so far
  std::atomic<int32_t> failed;    // 0: no failure; 1: being written; 2: `failure` readable
  char failure[2048];
};

struct alignas(kAlign) RankRec {
  std::atomic<int32_t> attached;
  int32_t process;  // jax.process_index() of the rank's process
  int32_t pid;
  int32_t device;   // the rank's XLA device ordinal in its process
  std::atomic<uint32_t> epoch;    // bumped after every progress word: the futex word
  std::atomic<int32_t> waiters;   // peers sleeping on `epoch`
  std::atomic<uint64_t> calls;    // calls this rank finished
  std::atomic<uint64_t> started;  // calls this rank started
};

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "process-shared flags need lock-free atomics");

size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

uint64_t Fnv1a(const int32_t* words, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  const auto* p = reinterpret_cast<const unsigned char*>(words);
  for (size_t i = 0; i < n * sizeof(int32_t); ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t ms) {
  timespec ts{static_cast<time_t>(ms / 1000), static_cast<long>((ms % 1000) * 1000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

bool ProcessGone(int32_t pid) { return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH; }

// This process's place in the job.
std::mutex g_mu;
std::string g_job_key;
int g_process = -1;

// One communicator as this process sees it: the mapping and the decoded program.
struct Segment {
  Segment(int64_t id, int32_t grp) : comm_id(id), group(grp) {}
  const int64_t comm_id;
  const int32_t group;
  std::mutex mu;  // set-up and configuration

  // Configuration, written once under mu by the first local rank.
  bool configured = false;
  std::vector<int32_t> words;
  Program program;
  int nranks = 0, ntrees = 0;
  cpu_walk::ScheduleLayout layout;  // children, gaps, who reads whose staging area
  std::vector<int32_t> rank_process, rank_device;  // from the lowering ([group * n + r]), may be empty
  std::vector<char> attached_here;                 // ranks this process attached

  // The mapping.
  std::string name;
  char* base = nullptr;
  size_t size = 0;
  bool linked = false;     // this process may have to unlink the name
  std::string open_error;  // a set-up that failed in this process fails every later call
  Header* hdr = nullptr;
  RankRec* ranks = nullptr;
  std::atomic<uint64_t>* progress = nullptr;
  char* data = nullptr;
  size_t stride = 0;
  std::atomic<bool> all_attached{false};
  std::atomic<int> in_flight{0};

  std::atomic<uint64_t>& word(int r, int t, int phase) {
    return progress[(static_cast<size_t>(r) * ntrees + t) * 2 + phase];
  }
  char* staging(int r) { return data + static_cast<size_t>(r) * stride; }

  // "rank 3 (process 1, device 5)": the mesh's device id and process from the lowering, else
  // what the rank recorded when it attached (its process and local device ordinal).
  std::string RankName(int r) const {
    std::string s = "rank " + std::to_string(r);
    const size_t i = static_cast<size_t>(group) * nranks + r;
    if (i < rank_process.size() && rank_process[i] >= 0) {
      s += " (process " + std::to_string(rank_process[i]);
      if (i < rank_device.size() && rank_device[i] >= 0) s += ", device " + std::to_string(rank_device[i]);
      return s + ")";
    }
    if (ranks != nullptr && ranks[r].attached.load() == 1)
      s += " (process " + std::to_string(ranks[r].process) + ", local device " +
           std::to_string(ranks[r].device) + ")";
    return s;
  }

  // Records the first failure and wakes every sleeper. Returns the failure on record.
  std::string Fail(const std::string& msg) {
    PostFailure(*hdr, msg);
    for (int r = 0; r < nranks; ++r) {
      ranks[r].epoch.fetch_add(1);
      FutexWakeAll(&ranks[r].epoch);
    }
    return Failure();
  }
  bool failed() const { return hdr->failed.load(std::memory_order_acquire) != 0; }
  std::string Failure() const {
    for (int i = 0; i < 100000 && hdr->failed.load(std::memory_order_acquire) == 1; ++i)
      std::this_thread::yield();
    return std::string(hdr->failure, strnlen(hdr->failure, sizeof hdr->failure));
  }

  void Unlink() {
    if (linked) {
      shm_unlink(name.c_str());
      linked = false;
    }
  }

  // Under mu, once: decode the program and lay out the segment.
  std::string Configure(const int32_t* prog, int64_t n, ffi::Span<const int32_t> procs,
                        ffi::Span<const int32_t> devs) {
    words.assign(prog, prog + n);
    std::string err = program.Decode(words.data(), n);
    if (!err.empty()) return err;
    nranks = program.nranks();
    ntrees = program.ntrees();
    layout.Build(program);
    attached_here.assign(nranks, 0);
    rank_process.assign(procs.begin(), procs.end());
    rank_device.assign(devs.begin(), devs.end());
    configured = true;
    return {};
  }

  // Under mu: create or open the segment and check that it holds this call's communicator.
  std::string Open(ffi::DataType dtype, int32_t op, int64_t esize, Clock::time_point deadline) {
    const size_t off_ranks = AlignUp(sizeof(Header));
    const size_t off_prog = AlignUp(off_ranks + nranks * sizeof(RankRec));
    const size_t off_data = AlignUp(off_prog + static_cast<size_t>(nranks) * ntrees * 2 * 8);
    stride = AlignUp(static_cast<size_t>(program.total_elems()) * esize);
    size = off_data + nranks * stride;
    const uint64_t hash = Fnv1a(words.data(), words.size());
    bool creator = false;
    int fd = -1;
    while (fd < 0) {
      fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd >= 0) {
        creator = true;
        linked = true;
        if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
          std::string e = std::strerror(errno);
          close(fd);
          Unlink();
          return "cannot size shared-memory segment " + name + " to " + std::to_string(size) +
                 " bytes (" + e + "; is /dev/shm large enough?)";
        }
        break;
      }
      if (errno != EEXIST) return "cannot create shared-memory segment " + name + ": " + std::strerror(errno);
      fd = shm_open(name.c_str(), O_RDWR, 0);
      if (fd < 0 && errno != ENOENT)
        return "cannot open shared-memory segment " + name + ": " + std::strerror(errno);
      if (fd < 0 && Clock::now() > deadline)
        return "shared-memory segment " + name + " vanished during set-up (a peer gave up)";
    }
    if (!creator) {
      linked = true;  // until the set-up completes, any rank may have to unlink it
      struct stat st;
      while (true) {
        if (fstat(fd, &st) != 0 || st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
          close(fd);
          return "shared-memory segment " + name + " is not this user's private segment; refusing it";
        }
        if (static_cast<size_t>(st.st_size) >= sizeof(Header)) break;
        if (Clock::now() > deadline) {
          close(fd);
          return "shared-memory segment " + name + " was never sized by the rank that created it";
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (static_cast<size_t>(st.st_size) != size) {
        // Another layout: read the creator's header alone, name both sides, and record the
        // failure there, so that the creator and every peer fail at once instead of waiting out
        // the set-up budget for a rank that will never attach.
        void* h = mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        std::string msg = "shared-memory segment " + name + " has " + std::to_string(st.st_size) +
                          " bytes, this call needs " + std::to_string(size);
        if (h != MAP_FAILED) {
          auto* theirs = static_cast<Header*>(h);
          while (theirs->magic.load(std::memory_order_acquire) != kMagic && Clock::now() <= deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          if (theirs->magic.load(std::memory_order_acquire) == kMagic)
            msg = Mismatch(*theirs, "size", dtype, op, esize);
          PostFailure(*theirs, msg);
          munmap(h, sizeof(Header));
        }
        return msg + kSameCollectives;
      }
    }
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return "cannot map shared-memory segment " + name + ": " + std::strerror(errno);
    base = static_cast<char*>(p);
    hdr = reinterpret_cast<Header*>(base);
    ranks = reinterpret_cast<RankRec*>(base + off_ranks);
    progress = reinterpret_cast<std::atomic<uint64_t>*>(base + off_prog);
    data = base + off_data;
    if (creator) {  // ftruncate zero-filled it: every flag starts at 0
      hdr->version = kLayoutVersion;
      hdr->nranks = nranks;
      hdr->ntrees = ntrees;
      hdr->dtype = static_cast<int32_t>(dtype);
      hdr->op = op;
      hdr->total_elems = program.total_elems();
      hdr->esize = esize;
      hdr->program_hash = hash;
      hdr->size = size;
      hdr->creator_process = g_process;
      hdr->magic.store(kMagic, std::memory_order_release);
      return {};
    }
    while (hdr->magic.load(std::memory_order_acquire) != kMagic) {
      if (Clock::now() > deadline) return "shared-memory segment " + name + " was never initialised";
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::string diff;
    if (hdr->version != kLayoutVersion) diff = "layout version";
    else if (hdr->nranks != nranks || hdr->ntrees != ntrees || hdr->program_hash != hash) diff = "schedule program";
    else if (hdr->dtype != static_cast<int32_t>(dtype)) diff = "dtype";
    else if (hdr->op != op) diff = "op";
    else if (hdr->total_elems != program.total_elems() || hdr->esize != esize) diff = "operand size";
    if (!diff.empty()) {
      const std::string msg = Mismatch(*hdr, diff, dtype, op, esize);
      PostFailure(*hdr, msg);
      return msg + kSameCollectives;
    }
    return {};
  }

  // Both sides of a call that differs from the segment's creator's: who, and with what.
  std::string Mismatch(const Header& theirs, const std::string& what, ffi::DataType dtype, int32_t op,
                       int64_t esize) const {
    auto side = [](int64_t elems, int64_t bytes, int32_t n, int32_t dt, int32_t o) {
      return std::to_string(elems) + " elements of " + std::to_string(bytes) + " bytes per rank (" +
             std::to_string(elems * bytes) + " bytes), " + std::to_string(n) + " ranks, XLA dtype id " +
             std::to_string(dt) + ", op " + std::to_string(o);
    };
    return "process " + std::to_string(g_process) + "'s call differs from process " +
           std::to_string(theirs.creator_process) + "'s in its " + what + ": process " +
           std::to_string(theirs.creator_process) + " set this call site up with " +
           side(theirs.total_elems, theirs.esize, theirs.nranks, theirs.dtype, theirs.op) +
           "; process " + std::to_string(g_process) + " calls it with " +
           side(program.total_elems(), esize, nranks, static_cast<int32_t>(dtype), op);
  }

  // The header's failure record (the first one stays); set-up waits read it within 1 ms.
  static void PostFailure(Header& h, const std::string& msg) {
    int32_t expected = 0;
    if (h.failed.compare_exchange_strong(expected, 1)) {
      std::snprintf(h.failure, sizeof h.failure, "%s", msg.c_str());
      h.failed.store(2, std::memory_order_release);
    }
  }
};

std::map<std::pair<int64_t, int32_t>, std::shared_ptr<Segment>> g_segs;

std::shared_ptr<Segment> GetSegment(int64_t comm_id, int32_t group) {
  std::lock_guard<std::mutex> g(g_mu);
  auto& s = g_segs[{comm_id, group}];
  if (!s) s = std::make_shared<Segment>(comm_id, group);
  return s;
}

// One rank's call.
class Call {
 public:
  Call(Segment& s, int rank, uint32_t g, int64_t timeout_ms)
      : s_(s), rank_(rank), g_(g), timeout_(timeout_ms) {}

  const std::string& error() const { return error_; }
  uint64_t base() const { return static_cast<uint64_t>(g_) << 32; }
  std::string Who() const {
    return "jax_blink: " + s_.RankName(rank_) + " of collective " + std::to_string(s_.comm_id) +
           " (group " + std::to_string(s_.group) + "), call #" + std::to_string(g_);
  }

  // Waits until `peer` has finished chunk `chunk` of (t, phase) in call g.
  bool Wait(int peer, int t, int phase, int64_t chunk) {
    std::atomic<uint64_t>& w = s_.word(peer, t, phase);
    const uint64_t target = base() | static_cast<uint64_t>(chunk + 1);
    auto reached = [&] {
      const uint64_t v = w.load(std::memory_order_acquire);
      return (v >> 32) == g_ && v >= target;
    };
    if (reached()) return true;
    RankRec& pr = s_.ranks[peer];
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::milliseconds(timeout_);
    for (int spin = 0;; ++spin) {
      if (s_.failed()) return Failed();
      if (reached()) return true;
      if (spin < 4) {  // a peer close behind: give it the core before sleeping
        std::this_thread::yield();
        continue;
      }
      const auto now = Clock::now();
      if (ProcessGone(pr.pid)) {
        error_ = Who() + ": the process of " + s_.RankName(peer) + " (pid " + std::to_string(pr.pid) +
                 ") has exited while this rank waited for it " + Step(t, phase, chunk) + ". " + Absent() +
                 "This collective fails on every rank from now on.";
        error_ = s_.Fail(error_);
        return false;
      }
      if (now >= deadline) {
        char secs[32];
        std::snprintf(secs, sizeof secs, "%.1f", std::chrono::duration<double>(now - start).count());
        error_ = Who() + " waited " + secs + " s for " + s_.RankName(peer) + " " + Step(t, phase, chunk) +
                 ". " + Absent() + "This collective fails on every rank from now on.";
        error_ = s_.Fail(error_);
        return false;
      }
      pr.waiters.fetch_add(1);
      const uint32_t e = pr.epoch.load();
      if (!reached() && !s_.failed()) {
        const int64_t left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
        FutexWait(&pr.epoch, e, std::max<int64_t>(1, std::min(left, kSliceMs)));
      }
      pr.waiters.fetch_sub(1);
    }
  }

  // Stores this rank's progress word: chunks [0, chunks) of (t, phase) are in its staging area.
  void Publish(int t, int phase, int64_t chunks) {
    s_.word(rank_, t, phase).store(base() | static_cast<uint64_t>(chunks), std::memory_order_release);
    RankRec& me = s_.ranks[rank_];
    me.epoch.fetch_add(1);
    if (me.waiters.load() > 0) FutexWakeAll(&me.epoch);
  }

  // cpu_walk's policy: peers in other processes read only the segment, so every rank's values,
  // its operand's included, are in its staging area.
  static constexpr bool kOperandShared = false;
  const char* Value(int peer, int /*t*/, bool /*leaf*/) { return s_.staging(peer); }
  const char* RootValue(int root, bool /*reduced*/) { return s_.staging(root); }
  // Chunks of (t, phase) that `peer` has finished in this call (after a successful Wait on it).
  uint64_t Progress(int peer, int t, int phase) const {
    const uint64_t v = s_.word(peer, t, phase).load(std::memory_order_acquire);
    return (v >> 32) == g_ ? (v & 0xffffffffu) : 0;
  }
  // A failed communicator keeps its mapping (no call runs on it again), so a copy from a peer's
  // staging area needs no bracket.
  bool BeginRead(const int32_t*, int) { return true; }
  void EndRead(const int32_t*, int) {}

  // Which ranks never started this call, and which processes have exited: who to blame.
  std::string Absent() const {
    std::string absent, gone;
    for (int r = 0; r < s_.nranks; ++r) {
      const RankRec& rr = s_.ranks[r];
      if (rr.started.load() < g_) absent += (absent.empty() ? "" : ", ") + s_.RankName(r);
      if (ProcessGone(rr.pid) && gone.find("pid " + std::to_string(rr.pid) + ")") == std::string::npos)
        gone += (gone.empty() ? "" : ", ") + std::string("process ") + std::to_string(rr.process) +
                " (pid " + std::to_string(rr.pid) + ")";
    }
    std::string out;
    if (!absent.empty()) out += "Ranks that never started this call: " + absent + " (their process skipped it or is stuck). ";
    if (!gone.empty()) out += "Exited: " + gone + ". ";
    if (out.empty()) out = "Every rank started this call (a peer is stuck). ";
    return out;
  }

  bool Failed() {
    error_ = Who() + ": this collective failed: " + s_.Failure();
    return false;
  }

 private:
  static const char* PhaseName(int phase) { return phase == kReduce ? "reduce" : "broadcast"; }
  static std::string Step(int t, int phase, int64_t chunk) {  // what a wait was for, in a message
    return "in tree " + std::to_string(t) + " chunk " + std::to_string(chunk) + " (" + PhaseName(phase) + ")";
  }
  Segment& s_;
  const int rank_;
  const uint32_t g_;
  const int64_t timeout_;
  std::string error_;
};

ffi::Error Fail(ffi::ErrorCode code, std::string msg) { return ffi::Error(code, std::move(msg)); }

// Attaches `rank` and waits (within the budget) until every rank has: the set-up barrier.
std::string Attach(Segment& s, int rank, int device, int64_t timeout_ms) {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(timeout_ms);
  {
    std::lock_guard<std::mutex> lk(s.mu);
    if (!s.open_error.empty()) return s.open_error;
    if (s.failed()) return "set-up failed: " + s.Failure();
    RankRec& me = s.ranks[rank];
    int32_t expected = 0;
    if (s.attached_here[rank]) {
      // attached by an earlier call of this process; wait below
    } else if (!me.attached.compare_exchange_strong(expected, 2)) {
      return "rank " + std::to_string(rank) + " was already attached by process " +
             std::to_string(me.process) + " (pid " + std::to_string(me.pid) +
             "): two devices run as the same rank of one group";
    } else {
      me.process = g_process;
      me.pid = static_cast<int32_t>(getpid());
      me.device = device;
      me.attached.store(1, std::memory_order_release);
      s.attached_here[rank] = 1;
      if (s.hdr->attached.fetch_add(1) + 1 == s.nranks) s.Unlink();
    }
  }
  while (s.hdr->attached.load(std::memory_order_acquire) < s.nranks) {
    // The name stays linked: a rank that arrives later must find this failure, not create a new
    // segment and wait out its budget alone (processes.cleanup unlinks it at exit).
    if (s.failed()) return "set-up failed: " + s.Failure();
    if (Clock::now() > deadline) {
      std::string missing, procs;
      std::vector<int> seen;
      for (int r = 0; r < s.nranks; ++r) {
        if (s.ranks[r].attached.load(std::memory_order_acquire) == 1) continue;
        missing += (missing.empty() ? "" : ", ") + s.RankName(r);
        const size_t i = static_cast<size_t>(s.group) * s.nranks + r;
        if (i < s.rank_process.size() &&
            std::find(seen.begin(), seen.end(), s.rank_process[i]) == seen.end()) {
          seen.push_back(s.rank_process[i]);
          procs += (procs.empty() ? "" : ", ") + std::to_string(s.rank_process[i]);
        }
      }
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.1f", std::chrono::duration<double>(Clock::now() - start).count());
      std::string msg = std::string("set-up timed out after ") + secs + " s: " +
                        (procs.empty() ? std::string("") : "process(es) " + procs + " did not answer; ") +
                        "ranks never attached: " + missing +
                        " (a process died, or never reached this collective)";
      msg = s.Fail(msg);
      std::lock_guard<std::mutex> lk(s.mu);
      s.Unlink();
      return msg;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.linked = false;  // the rank that completed the count unlinked the name
  }
  s.all_attached.store(true, std::memory_order_release);
  return {};
}

ffi::Error Execute(int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                   ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Span<const int32_t> program, int32_t op, int64_t comm_id, int64_t timeout_ms,
                   float /*host_share*/, ffi::Span<const int32_t> rank_process,
                   ffi::Span<const int32_t> rank_device, int64_t setup_timeout_ms) {
  const ffi::DataType dtype = x.element_type();
  auto dev = [&] {
    return "jax_blink (process " + std::to_string(g_process) + ", host device " + std::to_string(device) +
           ", collective " + std::to_string(comm_id) + "): ";
  };
  if (op < 0 || op > 2)
    return Fail(ffi::ErrorCode::kInvalidArgument, dev() + "op " + std::to_string(op) + " is not supported");
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
  if (setup_timeout_ms <= 0) setup_timeout_ms = timeout_ms;
  std::string key;
  {
    std::lock_guard<std::mutex> g(g_mu);
    key = g_job_key;
  }
  if (key.empty())
    return Fail(ffi::ErrorCode::kFailedPrecondition,
                dev() + "no job key: jax_blink.distributed.setup() was not called in this process");
  const int rank = rank_buf.typed_data()[0];
  const int32_t group = group_buf.typed_data()[0];
  const size_t esize = ffi::ByteWidth(dtype);

  std::shared_ptr<Segment> seg = GetSegment(comm_id, group);
  Segment& s = *seg;
  if (!s.all_attached.load(std::memory_order_acquire)) {
    std::string err;
    {
      std::lock_guard<std::mutex> lk(s.mu);
      if (!s.configured) {
        err = s.Configure(program.begin(), static_cast<int64_t>(program.size()), rank_process, rank_device);
        if (!err.empty()) return Fail(ffi::ErrorCode::kInvalidArgument, dev() + "bad schedule program: " + err);
      }
      if (rank < 0 || rank >= s.nranks)
        return Fail(ffi::ErrorCode::kInvalidArgument,
                    dev() + "rank " + std::to_string(rank) + " is outside the program's " +
                        std::to_string(s.nranks) + " ranks");
      if (s.base == nullptr && s.open_error.empty()) {
        s.name = "/jxb_" + key + "_" + std::to_string(comm_id) + "_" + std::to_string(group);
        s.open_error = s.Open(dtype, op, static_cast<int64_t>(esize),
                              Clock::now() + std::chrono::milliseconds(setup_timeout_ms));
      }
      err = s.open_error;
    }
    if (err.empty()) err = Attach(s, rank, device, setup_timeout_ms);
    if (!err.empty()) return Fail(ffi::ErrorCode::kDeadlineExceeded, dev() + err);
  }
  if (rank < 0 || rank >= s.nranks)
    return Fail(ffi::ErrorCode::kInvalidArgument, dev() + "rank " + std::to_string(rank) + " out of range");
  if (program.size() != s.words.size() || !std::equal(program.begin(), program.end(), s.words.begin()) ||
      static_cast<int64_t>(x.element_count()) != s.program.total_elems() ||
      static_cast<int32_t>(dtype) != s.hdr->dtype || op != s.hdr->op)
    return Fail(ffi::ErrorCode::kInvalidArgument,
                dev() + s.Fail("rank " + std::to_string(rank) + " ran collective " + std::to_string(comm_id) +
                               " with another program, dtype, op or size than its peers"));

  RankRec& me = s.ranks[rank];
  const uint32_t g = static_cast<uint32_t>(me.calls.load() + 1);
  Call call(s, rank, g, timeout_ms);
  if (s.failed()) {
    call.Failed();
    return Fail(ffi::ErrorCode::kAborted, call.error());
  }
  s.in_flight.fetch_add(1);
  me.started.store(g);
  char* st = s.staging(rank);
  // The schedule (cpu/schedule_walk.h) into this rank's staging area, where its peers read it.
  bool ok = cpu_walk::RunSteps(s.program, s.layout, call, rank, reduce, esize,
                               static_cast<const char*>(x.untyped_data()), st);
  if (ok) std::memcpy(out->untyped_data(), st, static_cast<size_t>(s.program.total_elems()) * esize);
  ok = ok && cpu_walk::WaitForReaders(s.program, s.layout, call, rank);
  if (ok) me.calls.store(g, std::memory_order_release);
  s.in_flight.fetch_sub(1);
  if (!ok) return Fail(ffi::ErrorCode::kDeadlineExceeded, call.error());
  return ffi::Error::Success();
}

// "jax_blink_after": out = x, once `dep` exists. Orders a program's collectives in a job of
// several processes (jax_blink/distributed.py): a custom call's operand cannot be optimised away.
ffi::Error After(ffi::AnyBuffer x, ffi::AnyBuffer /*dep*/, ffi::Result<ffi::AnyBuffer> out) {
  if (out->untyped_data() != x.untyped_data()) std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

}  // namespace

std::string SetJob(const std::string& job_key, int process_index) {
  std::lock_guard<std::mutex> g(g_mu);
  if (job_key.empty() || job_key.size() > 64 ||
      job_key.find_first_not_of("0123456789abcdef") != std::string::npos)
    return "job key must be 1 to 64 lowercase hex digits";
  if (!g_job_key.empty() && g_job_key != job_key)
    return "this process already belongs to job " + g_job_key + " (one job per process)";
  g_job_key = job_key;
  g_process = process_index;
  return {};
}

std::vector<std::string> Cleanup() {
  std::vector<std::string> unlinked;
  std::lock_guard<std::mutex> g(g_mu);
  for (auto it = g_segs.begin(); it != g_segs.end();) {
    Segment& s = *it->second;
    std::lock_guard<std::mutex> lk(s.mu);
    if (s.linked) {
      unlinked.push_back(s.name);
      s.Unlink();
    }
    if (s.in_flight.load() == 0) {
      if (s.base != nullptr) munmap(s.base, s.size);
      it = g_segs.erase(it);
    } else {
      ++it;
    }
  }
  return unlinked;
}

std::vector<std::string> LinkedSegments() {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> g(g_mu);
  for (auto& [key, s] : g_segs) {
    std::lock_guard<std::mutex> lk(s->mu);
    if (s->linked) out.push_back(s->name);
  }
  return out;
}

}  // namespace jax_blink::shm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkCollectiveShm, jax_blink::shm::Execute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>() JAX_BLINK_OPERANDS JAX_BLINK_CALL_ATTRS
                                      JAX_BLINK_PROCESS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkAfterCpu, jax_blink::shm::After,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());
