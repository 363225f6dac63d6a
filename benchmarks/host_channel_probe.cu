// Where the host channel's time goes: GPU <-> pinned host memory rates on GPU 0, by who moves the
// bytes (SM 16-byte stores/loads as the executor's host blocks do, TMA bulk copies through shared
// memory, copy engines) and in which direction (to host, from host, both at once).
//   nvcc -std=c++17 -O3 -arch=sm_90 -o /tmp/probe benchmarks/host_channel_probe.cu && /tmp/probe [MiB] [blocks]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                     \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) { std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); std::exit(1); } \
  } while (0)

constexpr int kThreads = 512;
constexpr int kTile = 32 << 10;  // TMA tile in shared memory

__global__ void sm_store(uint4* dst, const uint4* src, int64_t n) {  // device -> host, SM stores
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) dst[i] = src[i];
}
__global__ void sm_load(uint4* dst, const uint4* src, int64_t n) {  // host -> device, SM loads (.cv)
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) dst[i] = __ldcv(src + i);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// device -> host: tiles loaded into shared memory by the block, then one TMA bulk store per tile.
__global__ void tma_store(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  extern __shared__ __align__(128) uint8_t tile[];
  for (int64_t at = blockIdx.x * int64_t{kTile}; at < bytes; at += int64_t{gridDim.x} * kTile) {
    const int len = static_cast<int>(bytes - at < kTile ? bytes - at : kTile);
    for (int i = threadIdx.x * 16; i < len; i += kThreads * 16)
      *reinterpret_cast<uint4*>(tile + i) = *reinterpret_cast<const uint4*>(src + at + i);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + at), "r"(smem_addr(tile)), "r"(len)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// host -> device: one TMA bulk load per tile into shared memory (mbarrier), then stores by the block.
__global__ void tma_load(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  extern __shared__ __align__(128) uint8_t tile[];
  __shared__ __align__(8) uint64_t bar;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  uint32_t phase = 0;
  for (int64_t at = blockIdx.x * int64_t{kTile}; at < bytes; at += int64_t{gridDim.x} * kTile) {
    const int len = static_cast<int>(bytes - at < kTile ? bytes - at : kTile);
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&bar)), "r"(len) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(tile)),
                   "l"(src + at), "r"(len), "r"(smem_addr(&bar))
                   : "memory");
    }
    uint32_t done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(smem_addr(&bar)), "r"(phase) : "memory");
    phase ^= 1;
    for (int i = threadIdx.x * 16; i < len; i += kThreads * 16)
      *reinterpret_cast<uint4*>(dst + at + i) = *reinterpret_cast<const uint4*>(tile + i);
    __syncthreads();
  }
}

int main(int argc, char** argv) {
  const int64_t bytes = (argc > 1 ? std::atoll(argv[1]) : 256) << 20;
  const int blocks = argc > 2 ? std::atoi(argv[2]) : 16;
  uint8_t *d0, *d1, *h0, *h1;
  CK(cudaMalloc(&d0, bytes));
  CK(cudaMalloc(&d1, bytes));
  CK(cudaMemset(d0, 1, bytes));
  CK(cudaHostAlloc(&h0, bytes, cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined));
  CK(cudaHostAlloc(&h1, bytes, cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined));
  CK(cudaFuncSetAttribute(tma_store, cudaFuncAttributeMaxDynamicSharedMemorySize, kTile));
  CK(cudaFuncSetAttribute(tma_load, cudaFuncAttributeMaxDynamicSharedMemorySize, kTile));
  cudaStream_t s[2];
  CK(cudaStreamCreateWithFlags(&s[0], cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s[1], cudaStreamNonBlocking));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const int64_t n = bytes / 16;
  auto rate = [&](const char* what, auto&& go) {
    go();
    CK(cudaDeviceSynchronize());
    CK(cudaEventRecord(a, 0));
    for (int i = 0; i < 5; ++i) go();
    CK(cudaDeviceSynchronize());  // both streams (legacy stream 0 waits for neither: sync all)
    CK(cudaEventRecord(b, 0));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    std::printf("%-58s %7.1f GB/s per direction\n", what, 5.0 * bytes / (ms * 1e6));
  };
  std::printf("# GPU 0 <-> pinned host memory, %lld MiB per direction, %d blocks x %d threads (kernels)\n",
              static_cast<long long>(bytes >> 20), blocks, kThreads);
  auto to_host_sm = [&](cudaStream_t st) { sm_store<<<blocks, kThreads, 0, st>>>(reinterpret_cast<uint4*>(h0), reinterpret_cast<const uint4*>(d0), n); };
  auto from_host_sm = [&](cudaStream_t st) { sm_load<<<blocks, kThreads, 0, st>>>(reinterpret_cast<uint4*>(d1), reinterpret_cast<const uint4*>(h1), n); };
  auto to_host_tma = [&](cudaStream_t st) { tma_store<<<blocks, kThreads, kTile, st>>>(h0, d0, bytes); };
  auto from_host_tma = [&](cudaStream_t st) { tma_load<<<blocks, kThreads, kTile, st>>>(d1, h1, bytes); };
  auto to_host_ce = [&](cudaStream_t st) { CK(cudaMemcpyAsync(h0, d0, bytes, cudaMemcpyDeviceToHost, st)); };
  auto from_host_ce = [&](cudaStream_t st) { CK(cudaMemcpyAsync(d1, h1, bytes, cudaMemcpyHostToDevice, st)); };
  rate("SM stores, to host", [&] { to_host_sm(s[0]); });
  rate("SM loads (.cv), from host", [&] { from_host_sm(s[0]); });
  rate("SM stores + SM loads, both at once", [&] { to_host_sm(s[0]); from_host_sm(s[1]); });
  rate("TMA bulk stores, to host", [&] { to_host_tma(s[0]); });
  rate("TMA bulk loads, from host", [&] { from_host_tma(s[0]); });
  rate("TMA stores + TMA loads, both at once", [&] { to_host_tma(s[0]); from_host_tma(s[1]); });
  rate("TMA stores + SM loads, both at once", [&] { to_host_tma(s[0]); from_host_sm(s[1]); });
  rate("copy engine, to host", [&] { to_host_ce(s[0]); });
  rate("copy engine, from host", [&] { from_host_ce(s[0]); });
  rate("copy engines, both at once", [&] { to_host_ce(s[0]); from_host_ce(s[1]); });
  rate("copy engine to host + SM loads from host", [&] { to_host_ce(s[0]); from_host_sm(s[1]); });
  rate("SM stores to host + copy engine from host", [&] { to_host_sm(s[0]); from_host_ce(s[1]); });
  // Check the TMA paths moved the bytes.
  CK(cudaMemset(d1, 0, bytes));
  CK(cudaMemcpy(h1, d0, bytes, cudaMemcpyDeviceToHost));
  tma_load<<<blocks, kThreads, kTile>>>(d1, h1, bytes);
  CK(cudaDeviceSynchronize());
  uint8_t probe[16];
  CK(cudaMemcpy(probe, d1 + bytes - 16, 16, cudaMemcpyDeviceToHost));
  std::printf("# TMA load check: last byte %d (want 1)\n", probe[15]);
  return 0;
}
