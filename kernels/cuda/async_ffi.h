// The asynchronous all-reduce's FFI handlers (cuda/async_ffi.cc): what module.cc registers.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_blink::cuda_async {

// Adds "jax_blink_start" and "jax_blink_done" (FFI target name -> handler capsule) to `d`.
void AddTargets(nanobind::dict& d);
// Defines the module's functions of the asynchronous form (async_blocks, async_in_flight).
void Bind(nanobind::module_& m);

}  // namespace jax_blink::cuda_async
