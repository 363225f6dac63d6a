// nanobind module `jax_blink._blink_cuda`: the CUDA FFI handlers of "jax_blink_collective" (a thin
// layer over cuda/executor.h) and the executor's state (check, reset, sizes).
//
// Two bindings of the same collective:
//   full (JAX_BLINK_BINDING, target "jax_blink_collective"): operand, rank, group and every
//     attribute (program, op, comm_id, timeout_ms, host_share) on every call;
//   light (JAX_BLINK_LITE_BINDING, "jax_blink_collective_lite"): operand, rank, group and the
//     comm_id; the rest was registered once for that comm_id at lowering (register_call_site).
//     XLA decodes a binding on every call whatever the handler does, and the full binding's
//     decoding is a measurable share of a small call (benchmarks/NOTES.md, change 8).
//     jax_blink lowers GPU calls of one process to it (collectives._light_binding).
// Handler, per call (the fast path: no allocation, no host synchronisation, no lock):
//   dtype/shape checks; the device's error record (a read of pinned host memory): a kernel on
//   this GPU failed earlier -> ffi::Error with its message; the site of (comm_id, device) from a
//   thread-local cache; element size and length must match the site's (full binding: the program
//   too; light: the registered program was checked at registration and set-up); one launch
//   through the driver (cuLaunchKernel, the kernel's handle fetched at set-up; none for a one-rank
//   call whose result aliases its operand).
// First call of a (comm_id, device): reads rank and group from the device (a synchronous copy on
// the call's stream), then meets its peers on the host (JoinSite: registry keyed on (comm_id,
// group), condition variable with the call's deadline) and makes the site.
//
// Two handler symbols per binding:
//   JaxBlinkCollectiveCuda       the default (no traits); JaxBlinkCollectiveLiteCuda its light twin.
//   JaxBlinkCollectiveCudaGraph  the same, claiming the command-buffer trait (JaxBlinkCollectiveLiteCudaGraph). All per-call state
//     of the kernel lives on the device (call counters bumped by the kernel, flags that only grow,
//     pointers published by the kernel), so a captured launch replays correctly; the host-side
//     error check then runs only when XLA (re)records the command buffer, but a kernel on a failed
//     device still exits at once and check() reports it. Its one limit: the FIRST call of a call
//     site must not be captured (set-up reads rank/group synchronously and meets the peers): it
//     returns an error naming this if it finds the stream capturing. Opt in with
//     registrations(command_buffers=True).
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <iterator>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/async_ce.h"   // the copy engines' form: two-shot sites with JAX_BLINK_TWOSHOT_ENGINE=ce, ResetCopyEngines
#include "cuda/async_ffi.h"  // the asynchronous form: jax_blink_start / jax_blink_done
#include "cuda/pack_ffi.h"   // the bucket packing: jax_blink_pack / jax_blink_unpack
#include "cuda/executor.h"
#include "cuda/gpu_binding.h"
#include "cuda/ipc.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;
namespace jbc = jax_blink::cuda;

namespace {

std::atomic<uint64_t> g_generation{1};  // bumped by release(): invalidates the threads' caches

const char* FfiDtypeName(ffi::DataType dt) {
  switch (dt) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    default: return "an unsupported type";
  }
}

// What a lowered call site fixes (its program, op, time budget, host share), registered from
// Python at lowering (register_call_site) and keyed by its comm_id, which is unique per call site
// in a process: the light binding (JAX_BLINK_LITE_BINDING) then carries the comm_id alone, and XLA
// does not decode the program span and four more attributes on every call. Registered once, never changed: the "program differs" check is made
// here, at registration, instead of on every call.
struct CallSite {
  std::vector<int32_t> program;
  int32_t op = 0;
  int64_t timeout_ms = 0;
  float host_share = 0.f;
};
std::mutex g_call_sites_mu;
std::unordered_map<int64_t, std::unique_ptr<const CallSite>> g_call_sites;  // entries never move or die

std::string RegisterCallSite(int64_t comm_id, std::vector<int32_t> program, int32_t op, int64_t timeout_ms,
                             float host_share) {
  const std::string where = "jax_blink (collective " + std::to_string(comm_id) + "): ";
  if (op < 0 || op > 2) return where + "op " + std::to_string(op) + " is not supported; supported: 0 (sum), 1 (max), 2 (min)";
  if (program.empty()) return where + "the schedule program is empty";
  auto site = std::make_unique<CallSite>();
  site->program = std::move(program);
  site->op = op;
  site->timeout_ms = timeout_ms > 0 ? timeout_ms : 10000;
  site->host_share = host_share;
  std::lock_guard<std::mutex> lock(g_call_sites_mu);
  auto [it, fresh] = g_call_sites.try_emplace(comm_id, nullptr);
  if (fresh) {
    it->second = std::move(site);
    return {};
  }
  const CallSite& had = *it->second;
  if (had.program != site->program || had.op != site->op || had.timeout_ms != site->timeout_ms ||
      had.host_share != site->host_share)
    return where + "registered twice with a different program, op, time budget or host share (comm_ids are one "
                   "per lowered call site: a second lowering must take a new one)";
  return {};
}

const CallSite* FindCallSite(int64_t comm_id) {
  std::lock_guard<std::mutex> lock(g_call_sites_mu);
  auto it = g_call_sites.find(comm_id);
  return it == g_call_sites.end() ? nullptr : it->second.get();
}

// What this build holds for which GPUs: CMakeLists.txt resolves JAX_BLINK_CUDA_ARCHS and passes
// the result here, so that the module can say it without a tool (cuobjdump) or a GPU.
#if !defined(BLINK_CUBIN_ARCHS) || !defined(BLINK_PTX_ARCH) || !defined(BLINK_ARCHS_REQUESTED)
#error "build through CMakeLists.txt: it defines BLINK_CUBIN_ARCHS, BLINK_PTX_ARCH and BLINK_ARCHS_REQUESTED"
#endif
constexpr int kCubinArchs[] = {BLINK_CUBIN_ARCHS};
constexpr int kPtxArch = BLINK_PTX_ARCH;

std::string BuiltFor() {  // "sm_75, sm_80, ... and PTX compute_120"
  std::string s;
  for (int a : kCubinArchs) s += (s.empty() ? "sm_" : ", sm_") + std::to_string(a);
  return s + " and PTX compute_" + std::to_string(kPtxArch);
}

// Why this build's kernels cannot run on CUDA device `device`, or "" when they can: never a CUDA
// "no kernel image" deep inside a collective's first call.
std::string DeviceProblem(int device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess)
    return std::string("jax_blink: CUDA reports no usable GPU (cudaGetDeviceCount: ") + cudaGetErrorName(e) + ", " +
           cudaGetErrorString(e) + ")";
  if (device < 0 || device >= count)
    return "jax_blink: no CUDA device " + std::to_string(device) + " (this process sees " + std::to_string(count) + ")";
  cudaDeviceProp prop;
  e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess)
    return "jax_blink: cannot read the properties of CUDA device " + std::to_string(device) + " (" +
           cudaGetErrorName(e) + ", " + cudaGetErrorString(e) + ")";
  const std::string load = jbc::KernelImageProblem(device);
  if (load.empty()) return {};
  const std::string cc = std::to_string(prop.major) + std::to_string(prop.minor);
  return "jax_blink: the CUDA executor cannot run on GPU " + std::to_string(device) + " (" + prop.name +
         ", compute capability " + std::to_string(prop.major) + "." + std::to_string(prop.minor) +
         "): this build holds kernels for " + BuiltFor() + " (JAX_BLINK_CUDA_ARCHS=" + BLINK_ARCHS_REQUESTED +
         "), none of which runs there [" + load + "]. Rebuild jax_blink for it from its source tree with a CUDA "
         "compiler that supports sm_" + cc + ": pip install --no-build-isolation -Ccmake.define.JAX_BLINK_CUDA_ARCHS=" +
         cc + " -e . (or =native on that machine)";
}

struct CacheEntry {
  uint64_t generation = 0;
  int64_t comm_id = 0;
  int device = -1;
  jbc::Site* site = nullptr;
  const CallSite* call = nullptr;  // the light binding's registered site (nullptr for the full binding)
};
constexpr int kCacheWays = 16;
thread_local CacheEntry t_cache[kCacheWays];

const CacheEntry* Cached(int64_t comm_id, int device, uint64_t gen) {
  const CacheEntry& e = t_cache[static_cast<uint64_t>(comm_id * 31 + device) % kCacheWays];
  return (e.generation == gen && e.comm_id == comm_id && e.device == device) ? &e : nullptr;
}
void Remember(int64_t comm_id, int device, uint64_t gen, jbc::Site* s, const CallSite* call) {
  t_cache[static_cast<uint64_t>(comm_id * 31 + device) % kCacheWays] = CacheEntry{gen, comm_id, device, s, call};
}

std::string Where(int32_t device, int64_t comm_id) {  // error messages only
  return "jax_blink (GPU " + std::to_string(device) + ", collective " + std::to_string(comm_id) + "): ";
}

// The checks of every call that need no site: dtype, result shape, the device's error record.
ffi::Error CheckCall(int32_t device, int64_t comm_id, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer>& out,
                     jbc::DType* dtype) {
  const ffi::DataType dt = x.element_type();
  if (!jbc::ToDType(dt, dtype))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      Where(device, comm_id) + "dtype " + FfiDtypeName(dt) +
                          " is not supported; supported: float32, float64, bfloat16, float16, int32, int64");
  if (out->element_type() != dt || out->element_count() != x.element_count())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      Where(device, comm_id) + "the result must have the operand's shape and dtype");
  std::string failed = jbc::DeviceError(device);
  if (!failed.empty()) return ffi::Error(ffi::ErrorCode::kAborted, failed);
  return ffi::Error::Success();
}

// First call of (comm_id, device): read rank and group from the device, meet the peers, make the site.
ffi::Error SetUpSite(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> rank_buf,
                     ffi::Buffer<ffi::S32> group_buf, const int32_t* program, int64_t program_len, int esize,
                     int64_t comm_id, int64_t timeout_ms, float host_share, bool graph_handler, jbc::Site** site) {
  if (rank_buf.element_count() != 1 || group_buf.element_count() != 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, Where(device, comm_id) + "rank and group must be int32 scalars");
  *site = jbc::FindSite(comm_id, device);
  if (*site != nullptr) return ffi::Error::Success();
  if (graph_handler) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &cs) == cudaSuccess && cs != cudaStreamCaptureStatusNone)
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        Where(device, comm_id) +
                            "the first call of a collective cannot be captured in a command buffer "
                            "(set-up reads the rank and meets the peers on the host): run it once "
                            "without command buffers, or register the handler without them");
  }
  int32_t host[2] = {0, 0};
  cudaError_t e = cudaMemcpyAsync(&host[0], rank_buf.typed_data(), 4, cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaMemcpyAsync(&host[1], group_buf.typed_data(), 4, cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, Where(device, comm_id) + "reading rank and group: " + cudaGetErrorString(e));
  jbc::Options opt;
  opt.host_share = host_share;
  if (graph_handler) opt.host_engine = 0;  // the SM host channel replays; copy engines are enqueued per call
  std::string err = jbc::JoinSite(comm_id, host[1], host[0], device, program, program_len, esize, timeout_ms, opt, site);
  if (!err.empty()) return ffi::Error(ffi::ErrorCode::kInternal, err);
  return ffi::Error::Success();
}

// The checks of every call against its site, then the launch.
ffi::Error LaunchOnSite(jbc::Site* site, int32_t device, int64_t comm_id, jbc::DType dtype, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer>& out, int32_t op, int64_t timeout_ms, cudaStream_t stream) {
  if (jbc::SiteEsize(site) != static_cast<int>(ffi::ByteWidth(x.element_type())))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      Where(device, comm_id) + "element size differs from the one this collective was set up with");
  if (jbc::SiteTotalElems(site) != static_cast<int64_t>(x.element_count()))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      Where(device, comm_id) + "the operand has " + std::to_string(x.element_count()) +
                          " elements, the program " + std::to_string(jbc::SiteTotalElems(site)));
  std::string err;
  if (jbc::SiteTwoShotOnCopyEngines(site)) {
    // The copy engines' reduce-scatter and all-gather on this stream, the reduction on every SM.
    // It meets the other ranks on the host at every call, so it cannot be captured.
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &cs) == cudaSuccess && cs != cudaStreamCaptureStatusNone)
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        Where(device, comm_id) + "JAX_BLINK_TWOSHOT_ENGINE=ce cannot run inside a command buffer "
                                                 "(its ranks meet on the host at every call)");
    err = jax_blink::cuda_async::StartWithCopyEngines(
        comm_id, jbc::SiteRank(site), jbc::SiteRanks(site), device, dtype, op, x.untyped_data(), out->untyped_data(),
        static_cast<int64_t>(x.element_count()), jbc::SiteEsize(site), /*blocks: every SM*/ 0, stream, timeout_ms);
    if (!err.empty()) err = Where(device, comm_id) + err;
  } else {
    err = jbc::Launch(site, dtype, op, x.untyped_data(), out->untyped_data(), stream, timeout_ms);
  }
  if (!err.empty()) return ffi::Error(ffi::ErrorCode::kInternal, err);
  return ffi::Error::Success();
}

// The full binding: every attribute on every call (the IPC handler's shape; kept for executables
// lowered without register_call_site, e.g. exported ones, and as the measurement's reference).
ffi::Error Execute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                   ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Span<const int32_t> program, int32_t op, int64_t comm_id, int64_t timeout_ms,
                   float host_share, bool graph_handler) {
  jbc::DType dtype;
  if (ffi::Error e = CheckCall(device, comm_id, x, out, &dtype); e.failure()) return e;
  if (op < 0 || op > 2)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      Where(device, comm_id) + "op " + std::to_string(op) + " is not supported; supported: 0 (sum), 1 (max), 2 (min)");
  if (timeout_ms <= 0) timeout_ms = 10000;
  const uint64_t gen = g_generation.load(std::memory_order_acquire);
  jbc::Site* site = nullptr;
  if (const CacheEntry* hit = Cached(comm_id, device, gen)) site = hit->site;
  if (site == nullptr) {
    if (ffi::Error e = SetUpSite(stream, device, rank_buf, group_buf, program.begin(), static_cast<int64_t>(program.size()),
                                 static_cast<int>(ffi::ByteWidth(x.element_type())), comm_id, timeout_ms, host_share,
                                 graph_handler, &site);
        e.failure())
      return e;
    Remember(comm_id, device, gen, site, nullptr);
  }
  if (!jbc::SiteProgramMatches(site, program.begin(), static_cast<int64_t>(program.size())))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      Where(device, comm_id) + "the schedule program differs from the one this collective was set up with");
  return LaunchOnSite(site, device, comm_id, dtype, x, out, op, timeout_ms, stream);
}

// The light binding: the comm_id names the registered call site (program, op, time budget, host
// share). The rank and group operands are read at the site's first call only, as above.
ffi::Error ExecuteLite(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                       ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> out, int64_t comm_id,
                       bool graph_handler) {
  jbc::DType dtype;
  if (ffi::Error e = CheckCall(device, comm_id, x, out, &dtype); e.failure()) return e;
  const uint64_t gen = g_generation.load(std::memory_order_acquire);
  const CacheEntry* hit = Cached(comm_id, device, gen);
  if (hit == nullptr) {
    const CallSite* call = FindCallSite(comm_id);
    if (call == nullptr)
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        Where(device, comm_id) +
                            "this call site was not registered in this process (jax_blink registers it when it "
                            "lowers the call; an executable lowered elsewhere, e.g. exported, needs the full binding: "
                            "lower it with JAX_BLINK_FULL_BINDING=1)");
    jbc::Site* site = nullptr;
    if (ffi::Error e = SetUpSite(stream, device, rank_buf, group_buf, call->program.data(),
                                 static_cast<int64_t>(call->program.size()), static_cast<int>(ffi::ByteWidth(x.element_type())),
                                 comm_id, call->timeout_ms, call->host_share, graph_handler, &site);
        e.failure())
      return e;
    // A site joined through the full binding under the same comm_id (never done by jax_blink's
    // lowering, which gives each site one binding) must still run the registered program.
    if (!jbc::SiteProgramMatches(site, call->program.data(), static_cast<int64_t>(call->program.size())))
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        Where(device, comm_id) + "the schedule program differs from the one this collective was set up with");
    Remember(comm_id, device, gen, site, call);
    hit = Cached(comm_id, device, gen);
  }
  return LaunchOnSite(hit->site, device, comm_id, dtype, x, out, hit->call->op, hit->call->timeout_ms, stream);
}

ffi::Error ExecuteDefault(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank,
                          ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Span<const int32_t> program, int32_t op, int64_t comm_id, int64_t timeout_ms,
                          float host_share) {
  return Execute(stream, device, x, rank, group, out, program, op, comm_id, timeout_ms, host_share, false);
}

ffi::Error ExecuteGraph(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank,
                        ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Span<const int32_t> program, int32_t op, int64_t comm_id, int64_t timeout_ms,
                        float host_share) {
  return Execute(stream, device, x, rank, group, out, program, op, comm_id, timeout_ms, host_share, true);
}

ffi::Error ExecuteLiteDefault(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank,
                              ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> out, int64_t comm_id) {
  return ExecuteLite(stream, device, x, rank, group, out, comm_id, false);
}

ffi::Error ExecuteLiteGraph(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank,
                            ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> out, int64_t comm_id) {
  return ExecuteLite(stream, device, x, rank, group, out, comm_id, true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkCollectiveCuda, ExecuteDefault, JAX_BLINK_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkCollectiveLiteCuda, ExecuteLiteDefault, JAX_BLINK_LITE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkCollectiveLiteCudaGraph, ExecuteLiteGraph, JAX_BLINK_LITE_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkCollectiveCudaGraph, ExecuteGraph, JAX_BLINK_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});

NB_MODULE(_blink_cuda, m) {
  m.doc() = "jax_blink CUDA executor: the FFI handler of 'jax_blink_collective' for GPUs (peer access).";

  // Jobs of several processes: CUDA IPC regions, set up at trace time (jax_blink/distributed.py).
  m.def(
      "ipc_create",
      [](int64_t comm_id, int32_t group, int32_t rank, int32_t nranks, int64_t nbytes, int device,
         int32_t collective, int32_t root, std::vector<int32_t> processes) {
        std::vector<uint8_t> payload;
        std::string err = jax_blink::cuda_ipc::Create(comm_id, group, rank, nranks, nbytes, device,
                                                      static_cast<jax_blink::cuda_ipc::Collective>(collective),
                                                      root, processes, &payload);
        if (!err.empty()) throw std::runtime_error("jax_blink: " + err);
        return nb::bytes(reinterpret_cast<const char*>(payload.data()), payload.size());
      },
      nb::arg("comm_id"), nb::arg("group"), nb::arg("rank"), nb::arg("nranks"), nb::arg("nbytes"),
      nb::arg("device"), nb::arg("collective") = 0, nb::arg("root") = 0,
      nb::arg("processes") = std::vector<int32_t>(),
      "Register a rank's IPC region for `collective` (0 all-reduce, 1 all-gather, 2 reduce-scatter, "
      "3 broadcast, 4 reduce) rooted at `root`; `processes`: every rank's process index, for error "
      "messages. Returns the payload its peers open.");
  m.def(
      "ipc_open",
      [](int64_t comm_id, int32_t group, int32_t rank, int32_t peer, nb::bytes payload) {
        const auto* p = static_cast<const uint8_t*>(payload.data());
        std::string err = jax_blink::cuda_ipc::Open(comm_id, group, rank, peer,
                                                    std::vector<uint8_t>(p, p + payload.size()));
        if (!err.empty()) throw std::runtime_error("jax_blink: " + err);
      },
      nb::arg("comm_id"), nb::arg("group"), nb::arg("rank"), nb::arg("peer"), nb::arg("payload"),
      "Open a peer's IPC region for a local rank (raises where CUDA refuses, saying why).");
  m.def("ipc_registered", &jax_blink::cuda_ipc::Registered, nb::arg("comm_id"), nb::arg("device"));
  m.def("ipc_release", &jax_blink::cuda_ipc::ReleaseAll, "Free every IPC region (no call may run).");

  m.def(
      "registrations",
      [](bool command_buffers) {
        nb::dict d;
        d["jax_blink_collective"] = nb::capsule(reinterpret_cast<void*>(
            command_buffers ? &JaxBlinkCollectiveCudaGraph : &JaxBlinkCollectiveCuda));
        // The light binding (register_call_site first): the plain or the command-buffer handler.
        d["jax_blink_collective_lite"] = nb::capsule(reinterpret_cast<void*>(
            command_buffers ? &JaxBlinkCollectiveLiteCudaGraph : &JaxBlinkCollectiveLiteCuda));
        // Every collective across processes through CUDA IPC (cuda/ipc.h).
        d["jax_blink_collective_ipc"] = nb::capsule(reinterpret_cast<void*>(&JaxBlinkCollectiveIpc));
        // The asynchronous all-reduce (cuda/async_ffi.cc); neither claims the command-buffer trait.
        jax_blink::cuda_async::AddTargets(d);
        jax_blink::cuda_pack::AddTargets(d);
        return d;
      },
      nb::arg("command_buffers") = false,
      "FFI target name -> handler capsule, for jax.ffi.register_ffi_target(..., platform='CUDA'). "
      "command_buffers=True gives the handler that claims the command-buffer trait (its first call per "
      "call site must run uncaptured).");

  m.def(
      "register_call_site",
      [](int64_t comm_id, std::vector<int32_t> program, int32_t op, int64_t timeout_ms, float host_share) {
        std::string err = RegisterCallSite(comm_id, std::move(program), op, timeout_ms, host_share);
        if (!err.empty()) throw nb::value_error(err.c_str());
      },
      nb::arg("comm_id"), nb::arg("program"), nb::arg("op"), nb::arg("timeout_ms"), nb::arg("host_share"),
      "Register what a lowered call site of 'jax_blink_collective_lite' fixes (schedule program, op, time "
      "budget in ms, host share), keyed by its comm_id; registering a comm_id again with anything different "
      "raises ValueError. Needs no GPU.");

  m.def(
      "check",
      []() {
        std::string err = jbc::CheckAll();
        const std::string ipc = jax_blink::cuda_ipc::CheckAll();  // collectives across processes
        if (!ipc.empty()) err += (err.empty() ? "" : "\n") + ipc;
        if (!err.empty()) throw std::runtime_error(err);
      },
      "Raise RuntimeError if a kernel on any GPU recorded a failure (time-out, mismatch); failures are "
      "sticky until reset() (those of collectives across processes, CUDA IPC, for good).");

  m.def(
      "reset",
      []() {
        nb::gil_scoped_release nogil;
        std::string err = jbc::ResetAll();
        if (!err.empty()) throw std::runtime_error(err);
        err = jax_blink::cuda_ipc::ReleaseFailed();  // a failed IPC collective stays failed and holds no memory
        if (!err.empty()) throw std::runtime_error(err);
        err = jax_blink::cuda_async::ResetCopyEngines();  // a timed-out copy-engine collective starts afresh
        if (!err.empty()) throw std::runtime_error(err);
      },
      "Wait for every GPU with collective state, then clear every error record and restart every "
      "collective's call count on every rank (a copy-engine collective that timed out starts afresh); a "
      "CUDA IPC collective that failed keeps failing, and its memory and its mappings of the peers' memory "
      "are released. Call it only when no "
      "collective is running.");

  m.def(
      "staging_bytes",
      []() {
        int64_t most = 0;
        for (const jbc::CommInfo& c : jbc::Comms()) most = std::max(most, c.staging_bytes);
        return most;
      },
      "Largest staging allocation of any communicator, per rank, in bytes (the one-shot inbox and the "
      "copy-engine host channel's landing buffer; 0 until one of them was set up).");

  m.def(
      "comms",
      []() {
        nb::list out;
        for (const jbc::CommInfo& c : jbc::Comms()) {
          nb::dict d;
          d["devices"] = c.devices;
          d["blocks"] = c.blocks;
          d["staging_bytes"] = c.staging_bytes;
          d["control_bytes"] = c.control_bytes;
          d["host_bytes"] = c.host_bytes;
          d["num_sites"] = c.num_sites;
          nb::dict modes;
          for (int m = 0; m < jbc::kNumModes; ++m) modes[jbc::ModeName(static_cast<jbc::Mode>(m))] = c.sites_by_mode[m];
          d["sites_by_mode"] = modes;
          out.append(d);
        }
        return out;
      },
      "One dict per communicator (ordered device set): devices, blocks, staging_bytes (device memory per "
      "rank: the one-shot inbox, the copy-engine host channel's landing buffer), control_bytes (flags, "
      "pointer tables and plans of its call sites, on its largest device), "
      "host_bytes (pinned host memory of its host channel's outboxes, per rank), num_sites, sites_by_mode "
      "({'tree', 'll', 'oneshot', 'hybrid'} -> how many of its sites run each kernel).");

  m.def(
      "release",
      []() {
        nb::gil_scoped_release nogil;
        g_generation.fetch_add(1, std::memory_order_acq_rel);
        jbc::ReleaseAll();
      },
      "Free every communicator (registered with atexit; collectives set up again on their next call).");

  m.def("version", []() { return std::string(jbc::Version()); });
  jax_blink::cuda_async::Bind(m);  // async_blocks(), async_in_flight()

  m.def(
      "built_architectures", []() { return std::vector<int>(std::begin(kCubinArchs), std::end(kCubinArchs)); },
      "The GPU architectures this build holds cubins for, ascending: [75, 80, 86, ...] (sm_75 ...).");
  m.def(
      "ptx_architecture", []() { return kPtxArch; },
      "The architecture of the PTX this build holds (the newest of built_architectures()): a GPU newer "
      "than every cubin JIT-compiles it at first use.");
  m.def(
      "architectures_requested", []() { return std::string(BLINK_ARCHS_REQUESTED); },
      "JAX_BLINK_CUDA_ARCHS as the build was given it: 'all' (the default), 'native' or a list.");
  m.def(
      "device_problem",
      [](int device) -> std::optional<std::string> {
        std::string p = DeviceProblem(device);
        if (p.empty()) return std::nullopt;
        return p;
      },
      nb::arg("device"),
      "None when this build's kernels run on CUDA device `device` (a cubin for its architecture, or the "
      "PTX JIT-compiled for a newer GPU), else why not: the GPU's name and compute capability, the "
      "architectures built and the command that rebuilds jax_blink for it (or that CUDA sees no such GPU). "
      "Loads the kernels on that device.");

  m.def(
      "check_environment",
      []() {
        std::string err = jbc::CheckEnvironment();
        if (err.empty()) err = jax_blink::cuda_async::CheckCopyEngineEnvironment();
        if (!err.empty()) throw nb::value_error(err.c_str());
      },
      "Raise ValueError naming the first JAX_BLINK_* environment variable of the CUDA executor or of "
      "its copy engines whose value it does not understand (set-up of a collective fails with the same "
      "message); no GPU needed.");

  m.def(
      "parse_byte_count",
      [](const std::string& text) {
        int64_t v = 0;
        if (!jbc::ParseByteCount(text.c_str(), &v))
          throw nb::value_error(("not a byte count: '" + text + "' (examples: 8388608, 512K, 16M, 1G)").c_str());
        return v;
      },
      nb::arg("text"), "The executor's reading of a byte-count variable: '16M' -> 16777216 (binary units).");

  m.def(
      "can_access_peer",
      [](int device, int peer) {
        int ok = 0;
        const cudaError_t e = cudaDeviceCanAccessPeer(&ok, device, peer);
        if (e != cudaSuccess)
          throw std::runtime_error(std::string("cudaDeviceCanAccessPeer: ") + cudaGetErrorString(e));
        return ok != 0;
      },
      nb::arg("device"), nb::arg("peer"),
      "Whether CUDA device `device` can map `peer`'s memory (the executor needs it for every pair).");

  nb::module_::import_("atexit").attr("register")(m.attr("release"));
}
