// The bucket packing's FFI handlers (cuda/pack_ffi.cc): what module.cc registers.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_blink::cuda_pack {

// Adds "jax_blink_pack" and "jax_blink_unpack" (FFI target name -> handler capsule) to `d`.
void AddTargets(nanobind::dict& d);

}  // namespace jax_blink::cuda_pack
