"""The README documents every environment variable the package and the executors read."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_environment_variable_is_in_the_readme():
    sources = [*ROOT.glob("jax_blink/*.py"), *ROOT.glob("kernels/*.c*"), *ROOT.glob("kernels/*.h")]
    names, macros = set(), set()
    for path in sources:
        text = path.read_text()
        names |= set(re.findall(r"\bJAX_BLINK_[A-Z0-9_]+\b", text))
        macros |= set(re.findall(r"#define\s+(JAX_BLINK_[A-Z0-9_]+)", text))
    names -= macros
    assert "JAX_BLINK_ONESHOT_BYTES" in names and "JAX_BLINK_DISPATCH" in names  # the scan works
    readme = (ROOT / "README.md").read_text()
    assert sorted(n for n in names if n not in readme) == []
