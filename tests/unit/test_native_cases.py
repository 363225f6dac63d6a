"""The CUDA self-test's cases of the planner's all-reduce forms (tests/native/form_cases.inc) are
what tests/helpers/export_form_cases.py makes of jax_blink/planning/forms.py today."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_form_cases_of_the_cuda_self_test_are_up_to_date():
    out = subprocess.run([sys.executable, str(ROOT / "tests/helpers/export_form_cases.py"), "--check"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_self_test_includes_them():
    assert '#include "form_cases.inc"' in (ROOT / "tests/native/cuda_selftest.cu").read_text()
