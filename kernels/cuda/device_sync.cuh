// Device-side flag primitives of the CUDA executor (in the spirit of MSCCL++'s semaphore headers).
//
// Memory-ordering pattern used everywhere (PTX memory model, system scope because the two ends
// may sit on different GPUs):
//   producer: every thread stores its data; __syncthreads(); thread 0: st.release.sys flag
//             (the release is cumulative: it orders the block's stores, which thread 0 observed
//             through the barrier, before the flag);
//   consumer: thread 0: ld.acquire.sys flag until it is reached; __syncthreads(); every thread
//             loads the data (peer data is loaded with ld.global.cg: never from a stale L1 line).
// Flags are 32-bit call sequence numbers that only grow (wrap-safe comparisons: a call is
// "reached" when (int32)(flag - target) >= 0). A flag lives in the memory of the rank that waits
// on it (the producer writes it over NVLink), so every spin polls local memory.
#pragma once

#include <cstdint>

namespace jax_blink::cuda::sync {

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The same load without the compiler memory clobber: a snapshot that the compiler may issue
// together with the loads around it, so that a prologue's words cost one memory round trip, not
// one each (with the clobber every earlier load's use, e.g. its store to shared memory, must
// complete first). Only for words whose order against this thread's other accesses is irrelevant.
__device__ __forceinline__ uint32_t ld_relaxed_sys_snapshot(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ld_relaxed_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// LL ("low latency") lines: 16 bytes = {data0, flag0, data1, flag1}. Each 8-byte half is written
// and read as one unit (NVLink and the memory system do not tear aligned 8-byte accesses), so a
// reader that sees a half's flag also sees that half's data: no fence, no separate flag store.
__device__ __forceinline__ void st_volatile_v4(uint4* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}

__device__ __forceinline__ uint4 ld_volatile_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// (int32)(a - b) >= 0: a is at or past b, modulo 2^32.
__device__ __forceinline__ bool seq_reached(uint32_t a, uint32_t b) {
  return static_cast<int32_t>(a - b) >= 0;
}

enum WaitStatus : int { kWaitOk = 0, kWaitTimeout = 1, kWaitAhead = 2, kWaitAborted = 3, kWaitStopped = 4 };

// One thread spins until *flag reaches `target` (acquire), with a deadline in %globaltimer ns.
// Every 64 rounds it also polls two local words: `abort_word` (nonzero: the producer gave up on a
// call and will never publish: kWaitAborted) and `stop_word` (nonzero: a kernel on this device
// failed and the device is stopped: kWaitStopped).
// kWaitAhead: the flag is past `target`, i.e. the producer ran a later call than this one, which
// the protocol rules out between ranks that run the same calls (a mismatch).
// `observed` gets the last value read.
__device__ __forceinline__ int wait_flag(const uint32_t* flag, uint32_t target, uint64_t deadline_ns,
                                         const uint32_t* abort_word, const uint32_t* stop_word,
                                         uint32_t* observed) {
  uint32_t v = ld_acquire_sys(flag);
  for (uint32_t round = 1;; ++round) {
    if (seq_reached(v, target)) {
      *observed = v;
      return v == target ? kWaitOk : kWaitAhead;
    }
    if ((round & 63u) == 0) {
      *observed = v;
      if (ld_relaxed_sys(abort_word) != 0u) return kWaitAborted;
      if (ld_relaxed_sys(stop_word) != 0u) return kWaitStopped;
      if (globaltimer_ns() > deadline_ns) return kWaitTimeout;
      if (round > 4096u) __nanosleep(256);  // long waits: leave the memory system alone
    }
    v = ld_acquire_sys(flag);
  }
}

}  // namespace jax_blink::cuda::sync
