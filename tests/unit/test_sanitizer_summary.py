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
