// CUDA back end of "jax_blink_collective_ipc": see cuda_ipc.h.
//
// Region of one rank (cudaMalloc on its GPU, exported once with cudaIpcGetMemHandle):
//   [0, 256)                control: the push kernel's block counter
//   [off_flags, +4 nranks)  flag[p]: the last call number rank p pushed into this inbox
//   [off_inbox, ...)        inbox[parity][p]: rank p's operand of the calls of that parity
// Call g (numbered per rank, every rank runs the same calls): parity g & 1. The push kernel copies
// the operand into inbox[parity][rank] of every rank's region (its own included); its last block
// (block counter, __threadfence_system) stores g into flag[rank] of every region with st.release.sys.
// The reduce kernel: thread 0 of each block waits (ld.acquire.sys, deadline on %globaltimer) for
// flag[p] >= g for every p, then the block reduces inbox[parity][0..nranks) in rank order.
// Why two parities suffice: rank q writes parity (g & 1) of rank p's inbox in call g only after its
// call g - 1 saw every flag of call g - 1, and p stores its call g - 1 flags only after its call
// g - 2 reduce (stream order): p is done reading parity (g & 1) of call g - 2.
// A wait past its budget records who it waited for in pinned host memory; the next call on this
// GPU returns the error (a kernel cannot raise) naming the rank and its process.

#include "cuda_ipc.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "device_sync.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_blink::cuda_ipc {
namespace {

namespace sync = jax_blink::cuda::sync;

constexpr size_t kAlign = 256;
constexpr int kThreads = 512;
constexpr int kMaxBlocks = 64;

size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

struct ErrRec {  // pinned, mapped host memory: written by the reduce kernel on a timeout
  volatile int32_t failed;
  volatile int32_t waited_for;
  volatile uint32_t call;
  volatile uint32_t observed;
};

struct Comm {
  int64_t comm_id = 0;
  int32_t group = 0, rank = 0, nranks = 0;
  int device = 0;
  int64_t bytes = 0;
  size_t slot = 0, off_flags = 0, off_inbox = 0, size = 0;
  char* mine = nullptr;
  std::vector<char*> peers;      // every rank's region, as this process addresses it
  std::vector<char> opened_ipc;  // which peers[] came from cudaIpcOpenMemHandle
  int opened = 0;
  char** d_peers = nullptr;      // peers[] on the device, once every peer is open
  uint32_t seq = 0;
  ErrRec* err = nullptr;
  ErrRec* d_err = nullptr;
};

std::mutex g_mu;
std::map<std::tuple<int64_t, int32_t, int32_t>, std::unique_ptr<Comm>> g_comms;  // (comm, group, rank)
std::map<std::pair<int64_t, int>, Comm*> g_by_device;                           // (comm, device)

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

// ---------------------------------------------------------------------------------------------
// Kernels.

__global__ void PushKernel(const char* x, int64_t bytes, bool vec, char* const* peers, int nranks,
                           int rank, size_t dst_off, size_t off_flags, uint32_t seq,
                           unsigned* counter) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n16 = vec ? bytes / 16 : 0;
  for (int p = 0; p < nranks; ++p) {
    char* dst = peers[p] + dst_off;
    uint4* d16 = reinterpret_cast<uint4*>(dst);
    const uint4* s16 = reinterpret_cast<const uint4*>(x);
    for (int64_t i = tid; i < n16; i += stride) d16[i] = s16[i];
    for (int64_t i = n16 * 16 + tid; i < bytes; i += stride) dst[i] = x[i];
  }
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

template <class T, int OP>
__global__ void WaitReduceKernel(const char* mine, T* out, int64_t n, int nranks, size_t src_off,
                                 size_t slot, size_t off_flags, uint32_t seq, uint64_t timeout_ns,
                                 ErrRec* err) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    const uint32_t* flags = reinterpret_cast<const uint32_t*>(mine + off_flags);
    const uint64_t deadline = sync::globaltimer_ns() + timeout_ns;
    for (int p = 0; p < nranks && ok; ++p) {
      uint32_t v = sync::ld_acquire_sys(flags + p);
      for (uint32_t round = 1; !sync::seq_reached(v, seq); ++round) {
        if ((round & 63u) == 0) {
          if (err->failed != 0 || sync::globaltimer_ns() > deadline) {
            if (atomicCAS(const_cast<int32_t*>(&err->failed), 0, 1) == 0) {
              err->waited_for = p;
              err->call = seq;
              err->observed = v;
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
  if (!ok) return;
  using A = Acc<T>;
  const T* base = reinterpret_cast<const T*>(mine + src_off);
  const size_t slot_elems = slot / sizeof(T);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    auto acc = A::Load(__ldcg(base + i));
    for (int p = 1; p < nranks; ++p) acc = Combine<OP>(acc, A::Load(__ldcg(base + p * slot_elems + i)));
    out[i] = A::Store(acc);
  }
}

template <class T>
cudaError_t LaunchReduce(int op, int blocks, cudaStream_t s, const char* mine, void* out, int64_t n,
                         int nranks, size_t src_off, size_t slot, size_t off_flags, uint32_t seq,
                         uint64_t timeout_ns, ErrRec* err) {
  T* o = static_cast<T*>(out);
  if (op == 0) WaitReduceKernel<T, 0><<<blocks, kThreads, 0, s>>>(mine, o, n, nranks, src_off, slot, off_flags, seq, timeout_ns, err);
  else if (op == 1) WaitReduceKernel<T, 1><<<blocks, kThreads, 0, s>>>(mine, o, n, nranks, src_off, slot, off_flags, seq, timeout_ns, err);
  else WaitReduceKernel<T, 2><<<blocks, kThreads, 0, s>>>(mine, o, n, nranks, src_off, slot, off_flags, seq, timeout_ns, err);
  return cudaGetLastError();
}

ffi::Error Fail(ffi::ErrorCode code, std::string msg) { return ffi::Error(code, std::move(msg)); }

std::string RankName(int r, ffi::Span<const int32_t> procs, int group, int n) {
  const size_t i = static_cast<size_t>(group) * n + r;
  std::string s = "rank " + std::to_string(r);
  if (i < procs.size() && procs[i] >= 0) s += " (process " + std::to_string(procs[i]) + ")";
  return s;
}

ffi::Error Execute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> /*rank*/,
                   ffi::Buffer<ffi::S32> /*group*/, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Span<const int32_t> /*program*/, int32_t op, int64_t comm_id, int64_t timeout_ms,
                   float /*host_share*/, ffi::Span<const int32_t> rank_process,
                   ffi::Span<const int32_t> /*rank_device*/, int64_t /*setup_timeout_ms*/) {
  Comm* c = nullptr;
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_by_device.find({comm_id, device});
    if (it != g_by_device.end()) c = it->second;
  }
  const std::string where = "jax_blink (CUDA IPC, device " + std::to_string(device) + ", collective " +
                            std::to_string(comm_id) + "): ";
  if (c == nullptr || c->d_peers == nullptr)
    return Fail(ffi::ErrorCode::kFailedPrecondition,
                where + "not set up in this process (the lowering's set-up did not run for this device)");
  if (c->err->failed != 0)
    return Fail(ffi::ErrorCode::kDeadlineExceeded,
                where + RankName(c->rank, rank_process, c->group, c->nranks) + " waited past its budget for " +
                    RankName(c->err->waited_for, rank_process, c->group, c->nranks) + " in call #" +
                    std::to_string(c->err->call) + " (its last call here: #" + std::to_string(c->err->observed) +
                    "): a process skipped this collective, died or is stuck. This collective fails from now on.");
  if (static_cast<int64_t>(x.size_bytes()) != c->bytes || out->size_bytes() != x.size_bytes())
    return Fail(ffi::ErrorCode::kInvalidArgument, where + "operand size differs from the set-up's");
  if (op < 0 || op > 2) return Fail(ffi::ErrorCode::kInvalidArgument, where + "op must be 0, 1 or 2");
  const uint32_t seq = ++c->seq;
  const size_t par = seq & 1u;
  const size_t dst_off = c->off_inbox + (par * c->nranks + c->rank) * c->slot;
  const size_t src_off = c->off_inbox + par * c->nranks * c->slot;
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads)));
  const bool vec = reinterpret_cast<uintptr_t>(x.untyped_data()) % 16 == 0;
  PushKernel<<<blocks, kThreads, 0, stream>>>(static_cast<const char*>(x.untyped_data()), c->bytes, vec,
                                              c->d_peers, c->nranks, c->rank, dst_off, c->off_flags, seq,
                                              reinterpret_cast<unsigned*>(c->mine));
  const uint64_t tns = static_cast<uint64_t>(timeout_ms > 0 ? timeout_ms : 10000) * 1000000ull;
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) {
    switch (x.element_type()) {
      case ffi::DataType::F32: e = LaunchReduce<float>(op, blocks, stream, c->mine, out->untyped_data(), n, c->nranks, src_off, c->slot, c->off_flags, seq, tns, c->d_err); break;
      case ffi::DataType::F64: e = LaunchReduce<double>(op, blocks, stream, c->mine, out->untyped_data(), n, c->nranks, src_off, c->slot, c->off_flags, seq, tns, c->d_err); break;
      case ffi::DataType::S32: e = LaunchReduce<int32_t>(op, blocks, stream, c->mine, out->untyped_data(), n, c->nranks, src_off, c->slot, c->off_flags, seq, tns, c->d_err); break;
      case ffi::DataType::S64: e = LaunchReduce<long long>(op, blocks, stream, c->mine, out->untyped_data(), n, c->nranks, src_off, c->slot, c->off_flags, seq, tns, c->d_err); break;
      case ffi::DataType::BF16: e = LaunchReduce<__nv_bfloat16>(op, blocks, stream, c->mine, out->untyped_data(), n, c->nranks, src_off, c->slot, c->off_flags, seq, tns, c->d_err); break;
      case ffi::DataType::F16: e = LaunchReduce<__half>(op, blocks, stream, c->mine, out->untyped_data(), n, c->nranks, src_off, c->slot, c->off_flags, seq, tns, c->d_err); break;
      default: return Fail(ffi::ErrorCode::kInvalidArgument, where + "unsupported dtype");
    }
  }
  if (e != cudaSuccess) return Fail(ffi::ErrorCode::kInternal, where + CudaError("launch", e));
  return ffi::Error::Success();
}

}  // namespace

std::string Create(int64_t comm_id, int32_t group, int32_t rank, int32_t nranks, int64_t bytes, int device,
                   std::vector<uint8_t>* payload) {
  if (nranks < 2 || rank < 0 || rank >= nranks || bytes <= 0) return "bad rank, rank count or size";
  std::lock_guard<std::mutex> g(g_mu);
  auto key = std::make_tuple(comm_id, group, rank);
  if (g_comms.count(key)) return "rank " + std::to_string(rank) + " of this collective is already registered";
  auto c = std::make_unique<Comm>();
  c->comm_id = comm_id;
  c->group = group;
  c->rank = rank;
  c->nranks = nranks;
  c->device = device;
  c->bytes = bytes;
  c->slot = AlignUp(static_cast<size_t>(bytes));
  c->off_flags = kAlign;
  c->off_inbox = AlignUp(c->off_flags + 4 * static_cast<size_t>(nranks));
  c->size = c->off_inbox + 2 * static_cast<size_t>(nranks) * c->slot;
  DeviceGuard dg(device);
  cudaError_t e = cudaMalloc(&c->mine, c->size);
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
  DeviceGuard dg(c.device);
  if (pid == static_cast<uint64_t>(getpid())) {
    c.peers[peer] = reinterpret_cast<char*>(addr);  // this process's own memory (peer access as XLA set it)
  } else {
    void* p = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
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

void ReleaseAll() {
  std::lock_guard<std::mutex> g(g_mu);
  for (auto& [key, c] : g_comms) {
    DeviceGuard dg(c->device);
    for (int p = 0; p < c->nranks; ++p)
      if (c->opened_ipc[p]) cudaIpcCloseMemHandle(c->peers[p]);
    cudaFree(c->d_peers);
    cudaFree(c->mine);
    cudaFreeHost(const_cast<ErrRec*>(c->err));
  }
  g_comms.clear();
  g_by_device.clear();
}

}  // namespace jax_blink::cuda_ipc

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkCollectiveIpc, jax_blink::cuda_ipc::Execute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<xla::ffi::Span<const int32_t>>("program")
                                  .Attr<int32_t>("op")
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int64_t>("timeout_ms")
                                  .Attr<float>("host_share")
                                  .Attr<xla::ffi::Span<const int32_t>>("rank_process")
                                  .Attr<xla::ffi::Span<const int32_t>>("rank_device")
                                  .Attr<int64_t>("setup_timeout_ms"));
