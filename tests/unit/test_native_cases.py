"""The CUDA self-test's cases of the planner's all-reduce forms (tests/native/form_cases.inc) are
what tests/helpers/export_form_cases.py makes of jax_blink/planning/forms.py today."""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _labels(text: str) -> list[str]:
    # The case names without their segment counts: the LP's trees may differ between solver builds.
    return [re.sub(r" \(\d+ segments\)", "", m) for m in re.findall(r'cs.push_back\(\{"([^"]+)"', text)]


def test_the_form_cases_of_the_cuda_self_test_are_up_to_date():
    sys.path.insert(0, str(ROOT / "tests/helpers"))
    try:
        import export_form_cases
    finally:
        sys.path.pop(0)
    committed = (ROOT / "tests/native/form_cases.inc").read_text()
    assert _labels(committed) == _labels(export_form_cases.render()), \
        "run python tests/helpers/export_form_cases.py"
    assert len(_labels(committed)) == 16


def test_the_self_test_includes_them():
    assert '#include "form_cases.inc"' in (ROOT / "tests/native/cuda_selftest.cu").read_text()
