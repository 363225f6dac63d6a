"""benchmarks/sanitizer_summary.py: the one-line count of a compute-sanitizer log, on a log written
in compute-sanitizer's format (findings in our kernels and in XLA's, an API error, two processes)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import sanitizer_summary  # noqa: E402

LOG = """\
========= COMPUTE-SANITIZER
========= Program hit cudaErrorPeerAccessAlreadyEnabled (error 704) due to "peer access is already enabled" on CUDA API call to cudaDeviceEnablePeerAccess.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: [0x1234] in libcuda.so.1
========= Invalid __global__ write of size 4 bytes
=========     at jax_blink::cuda::(anonymous namespace)::collective_kernel(jax_blink::cuda::Params)+0x1a30
=========     by thread (3,0,0) in block (0,0,0)
========= Invalid __global__ read of size 16 bytes
=========     at loop_add_fusion+0x50
program output between the findings
========= Error: Race reported between Write access at void jax_blink::cuda::ll_kernel(jax_blink::cuda::Params)+0x80
=========     and Read access at void jax_blink::cuda::ll_kernel(jax_blink::cuda::Params)+0x90 [4 hazards]
========= ERROR SUMMARY: 3 errors
========= ERROR SUMMARY: 1 error
"""


def test_findings_are_split_into_ours_others_and_api_errors():
    p = sanitizer_summary.parse(LOG)
    assert p["summary_errors"] == 4 and p["processes"] == 2
    ours = {k[2]: v for k, v in p["findings"].items() if k[0]}
    assert ours == {"jax_blink::cuda::(anonymous namespace)::collective_kernel": 1,
                    "void jax_blink::cuda::ll_kernel": 1}
    assert {k[2] for k in p["findings"] if not k[0]} == {"loop_add_fusion"}
    assert dict(p["api"]) == {"cudaErrorPeerAccessAlreadyEnabled": 1}
    text = sanitizer_summary.line("memcheck driver", LOG, "0", "12")
    assert text.startswith("memcheck driver: rc=0 12s: 4 errors (sum of 2 summaries)")
    assert "in jax_blink kernels: 2" in text and "in other kernels: 1" in text and "CUDA API errors: 1" in text


def test_a_log_without_a_summary_says_so():
    text = sanitizer_summary.line("racecheck ipc", "========= COMPUTE-SANITIZER\nsome output\n")
    assert "0 errors (sum of 0 summaries)" in text and "NO SUMMARY" in text
    clean = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert "NO SUMMARY" not in sanitizer_summary.line("racecheck", clean)


def test_an_inlined_intrinsic_is_charged_to_its_kernel_and_unprinted_errors_are_not_a_summary():
    """memcheck names __ldcg in its "at" line when our kernel's load is inlined, and with more
    errors than --print-limit adds "ERROR SUMMARY: N errors were not printed" after the summary."""
    log = """\
========= Invalid __global__ read of size 16 bytes
=========     at __ldcg(const uint4 *)+0x1b100 in sm_32_intrinsics.hpp:177
=========     by thread (0,0,0) in block (61,0,0)
=========         Device Frame: T2 jax_blink::cuda::<unnamed>::ld_bypass<(bool)0, uint4>(const T2 *)+0x1b100 in device_kernels.cuh:159
=========         Device Frame: void jax_blink::cuda::<unnamed>::collective_kernel<E, Op>(Params)+0x19fe0 in device_kernels.cuh:621
========= Invalid __global__ read of size 4 bytes
=========     at sum_words+0x6e0
=========     by thread (224,0,0) in block (8,0,0)
========= ERROR SUMMARY: 18736 errors
========= ERROR SUMMARY: 18734 errors were not printed. Use --print-limit option to adjust the number of printed errors
"""
    p = sanitizer_summary.parse(log)
    assert p["summary_errors"] == 18736 and p["processes"] == 1
    assert {k[2]: v for k, v in p["findings"].items()} == {
        "void jax_blink::cuda::<unnamed>::collective_kernel<E, Op>": 1, "sum_words": 1}
    assert sum(v for k, v in p["findings"].items() if k[0]) == 1
