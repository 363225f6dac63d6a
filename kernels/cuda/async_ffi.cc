// The asynchronous all-reduce on GPUs: a start / done pair of FFI handlers around the CUDA
// executor (docs/overlap.md), so that a collective runs on a side stream beside XLA's compute.
//
//   jax_blink_start(x, rank, group) -> (x_passed, out)   x_passed aliases x (input_output_aliases)
//     records an event on XLA's stream, makes this device's side stream wait on it, launches the
//     site's kernel on the side stream (jbc::Launch, the executor's one launch path), records a
//     "done" event on the side stream into the FIFO of (comm_id, device), and returns: no host
//     synchronisation, nothing waits.
//   jax_blink_done(x_passed, out, token) -> out           the result aliases `out`
//     pops the FIFO's oldest event and makes XLA's stream wait on it (cudaStreamWaitEvent): the
//     host never waits. `token` is any value computed after the start of the next bucket: an
//     operand, so that XLA cannot schedule this done before it.
//
// Why the buffers are safe: XLA reuses a buffer after its last use in its own stream order. The
// operand x stays alive until done (x_passed aliases it and done consumes x_passed), and so does
// `out` (done returns it); done's wait puts every later use of their memory after the kernel.
//
// Why it cannot deadlock across GPUs: every rank issues its starts in program order (the same
// executable) onto ONE side stream per device, so the k-th asynchronous kernel of every rank is
// the same call; the kernels pair as on the compute stream. Asynchronous sites live on a
// communicator of their own (Options::lane = 1, keyed apart from the synchronous ones: their own
// one-shot inbox and call counters) with a small grid (JAX_BLINK_ASYNC_BLOCKS, default
// kDefaultAsyncBlocks), so that most SMs stay free for compute. Every wait of the kernel keeps the
// call's time budget; a kernel that gives up still completes, and so does the done event.
// A start with full_grid set (the last bucket of a step: nothing is left to overlap) runs on a
// third communicator (lane 2) with the executor's whole grid; it is serialised behind the small
// ones on the same side stream, so no two spinning grids of this device run at once.
//
// A site set up with JAX_BLINK_ASYNC_ENGINE=ce (but not a full_grid one, which always runs the
// kernel: it is the faster of the two alone) enqueues the copy-engine form instead of the kernel
// (cuda/async_ce.cc: peer copies on copy streams and a reduction, ordered by the side stream; it
// meets the other ranks on the host, so g_mu is released around it). Like the executor's knobs,
// the engine, its grid and its pieces are read once, when the site is set up.
//
// Neither handler claims the command-buffer trait: XLA then never captures them into a CUDA graph
// (the host work here must run at every call: the event record, the FIFO).
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/ffi_binding.h"
#include "cuda/async_ce.h"
#include "cuda/async_ffi.h"
#include "cuda/executor.h"
#include "cuda/gpu_binding.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;
namespace jbc = jax_blink::cuda;

namespace jax_blink::cuda_async {
namespace {

constexpr int kDefaultAsyncBlocks = 24;  // of 132 SMs on an H100/H200: the rest computes
constexpr int kMaxAsyncBlocks = 1024;
constexpr size_t kMaxInFlight = 256;     // starts without their done, per (site, device)

std::string Where(int32_t device, int64_t comm_id) {
  return "jax_blink async (GPU " + std::to_string(device) + ", collective " + std::to_string(comm_id) + "): ";
}

// JAX_BLINK_ASYNC_BLOCKS: the asynchronous communicator's grid. "" or an error message.
std::string AsyncBlocks(int* out) {
  *out = kDefaultAsyncBlocks;
  const char* v = std::getenv("JAX_BLINK_ASYNC_BLOCKS");
  if (v == nullptr || *v == '\0') return {};
  char* end = nullptr;
  const long b = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || b < 1 || b > kMaxAsyncBlocks)
    return std::string("JAX_BLINK_ASYNC_BLOCKS='") + v + "' is not a block count in [1, " +
           std::to_string(kMaxAsyncBlocks) + "] (the asynchronous collectives' grid; unset: " +
           std::to_string(kDefaultAsyncBlocks) + ")";
  *out = static_cast<int>(b);
  return {};
}

// Per device: the side stream (created once, non-blocking, the highest priority so that its
// blocks are scheduled ahead of compute blocks waiting for SMs), the fork event, and a pool of
// completion events. Per (comm_id, device): the FIFO of started calls' completion events.
struct DeviceLane {
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr;
  std::vector<cudaEvent_t> free_events;
};
std::mutex g_mu;  // uncontended: XLA drives each device from one thread
std::map<int, DeviceLane> g_lanes;
std::map<std::pair<int64_t, int>, std::deque<cudaEvent_t>> g_in_flight;

// What a site's starts run on, read from the environment at its first start (per comm_id; the
// copy engines' own settings: their group, cuda/async_ce.cc).
struct Engine {
  bool ce = false;  // copy engines (JAX_BLINK_ASYNC_ENGINE=ce) or the executor's kernel
  int blocks = 0;   // the copy engines' reduction grid (JAX_BLINK_ASYNC_BLOCKS)
};
std::map<int64_t, Engine> g_engines;

std::string CudaErr(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

struct DeviceGuard {
  int saved = -1;
  DeviceGuard() { cudaGetDevice(&saved); }
  ~DeviceGuard() { if (saved >= 0) cudaSetDevice(saved); }
};

// The lane of `device` (made at its first asynchronous call). Caller holds g_mu.
std::string LaneLocked(int device, DeviceLane** out) {
  DeviceLane& lane = g_lanes[device];
  if (lane.side == nullptr) {
    DeviceGuard guard;
    cudaError_t e = cudaSetDevice(device);
    int least = 0, greatest = 0;
    if (e == cudaSuccess) e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (e == cudaSuccess) e = cudaStreamCreateWithPriority(&lane.side, cudaStreamNonBlocking, greatest);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&lane.fork, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      lane.side = nullptr;
      return CudaErr("creating the side stream", e);
    }
  }
  *out = &lane;
  return {};
}

// A completion event of `device` from the pool (or a new one). Caller holds g_mu.
std::string TakeEventLocked(int device, DeviceLane& lane, cudaEvent_t* ev) {
  if (!lane.free_events.empty()) {
    *ev = lane.free_events.back();
    lane.free_events.pop_back();
    return {};
  }
  DeviceGuard guard;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(ev, cudaEventDisableTiming);
  return e == cudaSuccess ? std::string() : CudaErr("creating an event", e);
}

// The engine of site `comm_id` (read at its first start). Caller holds g_mu.
std::string EngineLocked(int64_t comm_id, bool full_grid, Engine* out) {
  auto it = g_engines.find(comm_id);
  if (it != g_engines.end()) {
    *out = it->second;
    return {};
  }
  Engine e;
  if (std::string err = AsyncEngineIsCopyEngines(&e.ce); !err.empty()) return err;
  if (std::string err = AsyncBlocks(&e.blocks); !err.empty()) return err;
  // The last bucket (full_grid) has nothing left to overlap, so it takes the faster engine: the
  // executor's whole grid (0.95x psum at 1 GiB on 4 x H200, the copy engines 0.67x; NOTES, change 19).
  if (full_grid) e.ce = false;
  *out = g_engines[comm_id] = e;
  return {};
}

// The site of (comm_id, device) on the asynchronous communicator; made at its first call (reads
// rank and group synchronously on XLA's stream, then meets the peers on the host: JoinSite).
std::string SiteOf(cudaStream_t stream, int32_t device, int64_t comm_id, ffi::Buffer<ffi::S32> rank_buf,
                   ffi::Buffer<ffi::S32> group_buf, ffi::Span<const int32_t> program, int esize,
                   int64_t timeout_ms, bool full_grid, jbc::Site** site) {
  *site = jbc::FindSite(comm_id, device);
  if (*site != nullptr) return {};
  if (rank_buf.element_count() != 1 || group_buf.element_count() != 1) return "rank and group must be int32 scalars";
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) == cudaSuccess && cs != cudaStreamCaptureStatusNone)
    return "the asynchronous collective cannot be captured in a command buffer (it records events per call)";
  int32_t host[2] = {0, 0};
  cudaError_t e = cudaMemcpyAsync(&host[0], rank_buf.typed_data(), 4, cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaMemcpyAsync(&host[1], group_buf.typed_data(), 4, cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return CudaErr("reading rank and group", e);
  jbc::Options opt;
  if (std::string err = AsyncBlocks(&opt.blocks); !err.empty()) return err;
  opt.lane = 1;
  if (full_grid) {  // the last bucket: nothing left to overlap, so the executor's whole grid
    opt.blocks = 0;
    opt.lane = 2;
  }
  opt.host_share = 0.0;  // no host channel: its 16 extra blocks would take most of a small grid
  return jbc::JoinSite(comm_id, host[1], host[0], device, program.begin(), static_cast<int64_t>(program.size()),
                       esize, timeout_ms, opt, site);
}

ffi::Error Fail(ffi::ErrorCode code, int32_t device, int64_t comm_id, const std::string& what) {
  return ffi::Error(code, Where(device, comm_id) + what);
}

ffi::Error Start(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                 ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> passed, ffi::Result<ffi::AnyBuffer> out,
                 ffi::Span<const int32_t> program, int32_t op, int64_t comm_id, int64_t timeout_ms,
                 int32_t full_grid) {
  jbc::DType dtype;
  const ffi::DataType dt = x.element_type();
  if (!jbc::ToDType(dt, &dtype))
    return Fail(ffi::ErrorCode::kInvalidArgument, device, comm_id,
                "dtype not supported; supported: float32, float64, bfloat16, float16, int32, int64");
  if (out->element_type() != dt || out->element_count() != x.element_count() || passed->element_type() != dt ||
      passed->element_count() != x.element_count())
    return Fail(ffi::ErrorCode::kInvalidArgument, device, comm_id, "both results must have the operand's shape and dtype");
  if (op < 0 || op > 2) return Fail(ffi::ErrorCode::kInvalidArgument, device, comm_id, "op must be 0 (sum), 1 (max) or 2 (min)");
  if (timeout_ms <= 0) timeout_ms = 10000;
  if (std::string failed = jbc::DeviceError(device); !failed.empty()) return ffi::Error(ffi::ErrorCode::kAborted, failed);
  const int esize = static_cast<int>(ffi::ByteWidth(dt));
  jbc::Site* site = nullptr;
  if (std::string err = SiteOf(stream, device, comm_id, rank_buf, group_buf, program, esize, timeout_ms,
                               full_grid != 0, &site);
      !err.empty())
    return Fail(ffi::ErrorCode::kInternal, device, comm_id, err);
  if (!jbc::SiteProgramMatches(site, program.begin(), static_cast<int64_t>(program.size())) ||
      jbc::SiteEsize(site) != esize || jbc::SiteTotalElems(site) != static_cast<int64_t>(x.element_count()))
    return Fail(ffi::ErrorCode::kInvalidArgument, device, comm_id,
                "the program, element size or length differs from the one this collective was set up with");
  // XLA aliases `passed` to x (input_output_aliases); where it did not, copy in stream order.
  if (passed->untyped_data() != x.untyped_data()) {
    cudaError_t e = cudaMemcpyAsync(passed->untyped_data(), x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return Fail(ffi::ErrorCode::kInternal, device, comm_id, CudaErr("copying the operand", e));
  }
  std::unique_lock<std::mutex> lock(g_mu);
  Engine engine;
  if (std::string err = EngineLocked(comm_id, full_grid != 0, &engine); !err.empty())
    return Fail(ffi::ErrorCode::kInvalidArgument, device, comm_id, err);
  if (g_in_flight[{comm_id, device}].size() >= kMaxInFlight)
    return Fail(ffi::ErrorCode::kResourceExhausted, device, comm_id,
                std::to_string(g_in_flight[{comm_id, device}].size()) +
                    " starts without a done: every jax_blink_start needs its jax_blink_done");
  DeviceLane* lane = nullptr;
  if (std::string err = LaneLocked(device, &lane); !err.empty()) return Fail(ffi::ErrorCode::kInternal, device, comm_id, err);
  cudaEvent_t done = nullptr;
  if (std::string err = TakeEventLocked(device, *lane, &done); !err.empty())
    return Fail(ffi::ErrorCode::kInternal, device, comm_id, err);
  auto give_back = [&] {
    if (!lock.owns_lock()) lock.lock();
    lane->free_events.push_back(done);
  };
  // Fork: the side stream starts where XLA's stream is now (x is written, `out`'s memory free).
  cudaError_t e = cudaEventRecord(lane->fork, stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(lane->side, lane->fork, 0);
  if (e != cudaSuccess) {
    give_back();
    return Fail(ffi::ErrorCode::kInternal, device, comm_id, CudaErr("forking the side stream", e));
  }
  std::string launched;
  if (engine.ce) {
    // The copy engines' form meets the other ranks on the host: never while holding g_mu, which
    // their own starts need. Only this device's thread uses this side stream meanwhile.
    lock.unlock();
    launched = StartWithCopyEngines(comm_id, jbc::SiteRank(site), jbc::SiteRanks(site), device, dtype, op,
                                    x.untyped_data(), out->untyped_data(), static_cast<int64_t>(x.element_count()),
                                    esize, engine.blocks, lane->side, timeout_ms);
    lock.lock();
  } else {
    launched = jbc::Launch(site, dtype, op, x.untyped_data(), out->untyped_data(), lane->side, timeout_ms);
  }
  if (!launched.empty()) {
    give_back();
    return Fail(ffi::ErrorCode::kInternal, device, comm_id, launched);
  }
  e = cudaEventRecord(done, lane->side);
  if (e != cudaSuccess) {
    // The kernel runs but nothing would mark its end: make XLA's stream wait for the whole side
    // stream now instead (slower, still correct).
    lane->free_events.push_back(done);
    cudaEventRecord(lane->fork, lane->side);
    cudaStreamWaitEvent(stream, lane->fork, 0);
    return Fail(ffi::ErrorCode::kInternal, device, comm_id, CudaErr("recording the done event", e));
  }
  g_in_flight[{comm_id, device}].push_back(done);
  return ffi::Error::Success();
}

ffi::Error Done(cudaStream_t stream, int32_t device, ffi::AnyBuffer passed, ffi::AnyBuffer result,
                ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> out, int64_t comm_id) {
  (void)passed;  // an operand only so that x stays alive (and unwritten) until here
  (void)token;   // an operand only so that XLA schedules this done after the token exists
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_in_flight.find({comm_id, device});
    if (it == g_in_flight.end() || it->second.empty())
      return Fail(ffi::ErrorCode::kFailedPrecondition, device, comm_id,
                  "jax_blink_done without a jax_blink_start in flight (each start has exactly one done, after it)");
    ev = it->second.front();
    it->second.pop_front();
    // Waiting on the event now captures its current record: re-recording it later (after it
    // returns to the pool) does not change this wait (CUDA's cudaStreamWaitEvent semantics).
    cudaError_t e = cudaStreamWaitEvent(stream, ev, 0);
    g_lanes[device].free_events.push_back(ev);
    if (e != cudaSuccess) return Fail(ffi::ErrorCode::kInternal, device, comm_id, CudaErr("waiting for the collective", e));
  }
  if (out->untyped_data() != result.untyped_data()) {  // XLA aliases them; where it did not, copy
    cudaError_t e = cudaMemcpyAsync(out->untyped_data(), result.untyped_data(), result.size_bytes(),
                                    cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return Fail(ffi::ErrorCode::kInternal, device, comm_id, CudaErr("copying the result", e));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkStartCuda, Start,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int32_t>>("program")
                                  .Attr<int32_t>("op")
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int64_t>("timeout_ms")
                                  .Attr<int32_t>("full_grid"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkDoneCuda, Done,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm_id"));

void AddTargets(nb::dict& d) {
  d["jax_blink_start"] = nb::capsule(reinterpret_cast<void*>(&JaxBlinkStartCuda));
  d["jax_blink_done"] = nb::capsule(reinterpret_cast<void*>(&JaxBlinkDoneCuda));
}

void Bind(nb::module_& m) {
  m.def(
      "async_blocks",
      []() {
        int b = 0;
        std::string err = AsyncBlocks(&b);
        if (!err.empty()) throw nb::value_error(err.c_str());
        return b;
      },
      "The grid of the asynchronous collectives' communicator (JAX_BLINK_ASYNC_BLOCKS, default 24); "
      "raises ValueError naming a value it does not understand.");
  m.def(
      "async_in_flight",
      []() {
        std::lock_guard<std::mutex> lock(g_mu);
        size_t n = 0;
        for (auto& [key, fifo] : g_in_flight) n += fifo.size();
        return n;
      },
      "Asynchronous collectives started and not yet awaited by a done, over every site and device "
      "(0 after every complete program).");
}

}  // namespace jax_blink::cuda_async
