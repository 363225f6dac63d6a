// Element types and combining ops of the CPU back ends: the in-process executor
// (cpu/executor.cc) and the shared-memory one (cpu/shm.cc). 16-bit floats accumulate in float32
// and round once per hop.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace jax_blink::cpu_reduce {

namespace ffi = xla::ffi;

inline uint32_t F32Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsF32(uint32_t u) {
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

// Round to nearest even, NaN stays a (quiet) NaN: as ml_dtypes does. Branch-free (a select on a
// signed compare), so that the reduce loops vectorise: with a branch, bfloat16 max ran ~30x slower.
inline uint16_t F32ToBf16(float f) {
  const uint32_t u = F32Bits(f);
  const int32_t magnitude = static_cast<int32_t>(u & 0x7fffffffu);
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(magnitude > 0x7f800000 ? quiet_nan : rounded);
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
// one rounding at the end). `out` may alias `in`, never a kid. Several kids accumulate block by
// block in a buffer that stays in L1, so `out` is written once (not once per kid).
using ReduceFn = void (*)(void* out, const void* in, const void* const* kids, int nkids, int64_t n);

template <class T, class Op>
inline void ReduceChunk(void* out_v, const void* in_v, const void* const* kids_v, int nkids, int64_t n) {
  T* out = static_cast<T*>(out_v);
  const T* in = static_cast<const T*>(in_v);
  const T* k0 = static_cast<const T*>(kids_v[0]);
  using E = Elem<T>;
  using A = typename E::Acc;
  if (nkids == 1) {
    for (int64_t i = 0; i < n; ++i) out[i] = E::Store(Op::Apply(E::Load(in[i]), E::Load(k0[i])));
    return;
  }
  constexpr int64_t kBlock = 1024;
  alignas(64) A acc[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = std::min(kBlock, n - i0);
    for (int64_t j = 0; j < m; ++j) acc[j] = Op::Apply(E::Load(in[i0 + j]), E::Load(k0[i0 + j]));
    for (int k = 1; k < nkids; ++k) {
      const T* kk = static_cast<const T*>(kids_v[k]) + i0;
      for (int64_t j = 0; j < m; ++j) acc[j] = Op::Apply(acc[j], E::Load(kk[j]));
    }
    for (int64_t j = 0; j < m; ++j) out[i0 + j] = E::Store(acc[j]);
  }
}

template <class T>
inline ReduceFn PickOp(int32_t op) {
  switch (op) {
    case 0: return &ReduceChunk<T, SumOp>;
    case 1: return &ReduceChunk<T, MaxOp>;
    case 2: return &ReduceChunk<T, MinOp>;
  }
  return nullptr;
}

// nullptr for an unsupported dtype.
inline ReduceFn PickReduce(ffi::DataType dtype, int32_t op) {
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

inline const char* DtypeName(ffi::DataType dtype) {
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

inline const char* OpName(int32_t op) { return op == 0 ? "sum" : op == 1 ? "max" : op == 2 ? "min" : "?"; }

}  // namespace jax_blink::cpu_reduce
