// nanobind module `jax_blink._blink_cpu`: the CPU executor's FFI handler and its communicator state.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "cpu/executor.h"
#include "cpu/shm.h"

namespace nb = nanobind;

NB_MODULE(_blink_cpu, m) {
  m.doc() = "jax_blink CPU executor: the FFI handler of 'jax_blink_collective' for XLA host devices.";

  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["jax_blink_collective"] = nb::capsule(reinterpret_cast<void*>(&JaxBlinkCollectiveCpu));
        // Ranks in several processes of one machine (cpu/shm.h).
        d["jax_blink_collective_mp"] = nb::capsule(reinterpret_cast<void*>(&JaxBlinkCollectiveShm));
        d["jax_blink_after"] = nb::capsule(reinterpret_cast<void*>(&JaxBlinkAfterCpu));
        return d;
      },
      "FFI target name -> handler capsule, for jax.ffi.register_ffi_target(..., platform='cpu').");

  m.def(
      "reset",
      []() {
        std::string err = jax_blink::cpu::ResetAll();
        if (!err.empty()) throw std::runtime_error(err);
      },
      "Drop the state of every communicator (raises if a call is running).");

  m.def("num_comms", &jax_blink::cpu::NumComms,
        "Number of (comm_id, group) communicators with state.");

  m.def(
      "comm_status",
      [](int64_t comm_id, int32_t group) -> nb::object {
        jax_blink::cpu::CommStatus s = jax_blink::cpu::Status(comm_id, group);
        if (!s.exists) return nb::none();
        nb::dict d;
        d["configured"] = s.configured;
        d["nranks"] = s.nranks;
        d["in_flight"] = s.in_flight;
        d["failures"] = s.failures;
        d["in_place_calls"] = s.in_place_calls;
        d["open_calls"] = s.open_calls;
        d["failed_calls"] = s.failed_calls;
        nb::list calls;
        for (uint64_t v : s.calls) calls.append(v);
        d["calls"] = calls;
        return d;
      },
      nb::arg("comm_id"), nb::arg("group") = 0,
      "State of one communicator (None when it has none): for tests and debugging.");

  m.def("version", &jax_blink::cpu::Version);

  // Jobs of several processes (cpu/shm.h).
  m.def(
      "shm_set_job",
      [](const std::string& key, int process_index) {
        std::string err = jax_blink::shm::SetJob(key, process_index);
        if (!err.empty()) throw std::invalid_argument("jax_blink: " + err);
      },
      nb::arg("job_key"), nb::arg("process_index"),
      "This process's job key (hex, from the job's key-value store) and process index.");
  m.def("shm_cleanup", &jax_blink::shm::Cleanup,
        "Unlink segments whose set-up never completed and unmap idle ones; returns the names unlinked.");
  m.def("shm_linked", &jax_blink::shm::LinkedSegments,
        "Names of this process's segments that are still linked in /dev/shm.");
}
