"""The call path never imports the tools: tools stand above the library, so that importing
jax_blink (or running a collective) cannot pull in the bench, the chunk search, the demo, the
pictures or the command line, and no import circle runs through them."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jax_blink"

# topology -> plan -> schedule -> lowering -> executor, with the options and the dispatch table.
CALL_PATH = ("jax_blink", "jax_blink._backends", "jax_blink.topology", "jax_blink.treegen",
             "jax_blink.schedule", "jax_blink.collectives", "jax_blink.options", "jax_blink.tuning",
             "jax_blink.chunk_cache", "jax_blink.distributed", "jax_blink.hierarchy",
             "jax_blink.switch", "jax_blink._jax_internals", "jax_blink.buckets", "jax_blink.call_order",
             "jax_blink.merge")
# Above it: they may import the call path, never the other way round.
TOOLS = ("jax_blink.bench", "jax_blink.autotune", "jax_blink.demo", "jax_blink.draw",
         "jax_blink.simulate", "jax_blink.__main__", "jax_blink._cli", "jax_blink.train")


def _module_name(path: Path) -> str:
    return "jax_blink" if path.name == "__init__.py" else f"jax_blink.{path.stem}"


def test_every_module_is_on_the_call_path_or_a_tool():
    modules = {_module_name(p) for p in PACKAGE.glob("*.py")}
    assert sorted(modules - set(CALL_PATH) - set(TOOLS)) == [], "classify the new module in this test"
    assert set(CALL_PATH) <= modules and {"jax_blink.bench", "jax_blink.autotune"} <= modules
    assert not set(CALL_PATH) & set(TOOLS)


def _imported_package_modules(path: Path) -> set[str]:
    """Every jax_blink module an import statement of ``path`` names, at the top or in a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x / from .x import y
                base = "jax_blink" + (f".{node.module}" if node.module else "")
                out |= {base} if node.module else {f"jax_blink.{a.name}" for a in node.names}
            elif node.module and node.module.split(".")[0] == "jax_blink":
                out.add(node.module)
                out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "jax_blink"}
    return out


@pytest.mark.parametrize("module", CALL_PATH)
def test_no_call_path_module_names_a_tool(module):
    # Also imports inside functions: a lazy import of a tool would bring the circle back.
    path = PACKAGE / ("__init__.py" if module == "jax_blink" else f"{module.split('.')[1]}.py")
    assert sorted(_imported_package_modules(path) & set(TOOLS)) == []


def test_the_scan_sees_imports_inside_functions():
    # autotune's search imports the bench inside tune_chunk: the scan must find such an import.
    assert "jax_blink.bench" in _imported_package_modules(PACKAGE / "autotune.py")


def test_importing_the_call_path_loads_no_tool():
    """Each call-path module in a fresh interpreter (the subprocesses run side by side)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    code = ("import importlib, sys\n"
            "importlib.import_module(sys.argv[1])\n"
            f"print(sorted(m for m in {TOOLS!r} if m in sys.modules))\n")
    procs = {m: subprocess.Popen([sys.executable, "-c", code, m], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for m in CALL_PATH}
    loaded = {}
    for module, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"import {module}: {err}"
        loaded[module] = out.strip()
    assert loaded == {m: "[]" for m in CALL_PATH}
