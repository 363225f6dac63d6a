"""The house rules, read off the source: the package is layers of folders, each importing only the
layers below it; the tools stand above all and nothing in the library imports them; no import
circle anywhere, counting imports inside functions; ``import jax_blink`` loads no tool."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jax_blink"

#: Bottom to top. A module may import its own layer and the layers below it.
LAYERS = ("options", "planning", "lowering", "switch", "api", "tools")
#: The package's own files: __init__ is the library's face (it may import every layer but tools),
#: __main__ the command line's door (it imports tools alone).
TOP = {"jax_blink": len(LAYERS) - 2, "jax_blink.__main__": len(LAYERS) - 1}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> int:
    if module in TOP:
        return TOP[module]
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    if parts[1:2] and parts[1].startswith("_blink_"):
        return -1  # the compiled executors, below everything
    raise AssertionError(f"{module}: not in a layer folder ({', '.join(LAYERS)}); move it into one")


def _imports(path: Path) -> set[str]:
    return _imports_of(path.read_text(), _module_name(path), path.name == "__init__.py")


def _imports_of(source: str, module: str, is_package: bool) -> set[str]:
    """Every jax_blink module that an import statement of ``source`` names, at the top or inside a
    function (a lazy import would hide a circle otherwise)."""
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] != "jax_blink":
                continue
            # from pkg import submodule names a module; from module import attr names the module
            named = {f"{name}.{a.name}" for a in node.names} & (MODULES.keys() | {"jax_blink._blink_cpu",
                                                                                    "jax_blink._blink_cuda"})
            out |= named or {name}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "jax_blink"}
    out.discard(module)
    return {m for m in out if m in MODULES or m.startswith("jax_blink._blink_")}


GRAPH = nx.DiGraph((m, i) for m, p in MODULES.items() for i in _imports(p))


def test_every_module_sits_in_a_layer():
    for module in MODULES:
        _layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_its_layer_and_below(module):
    own = _layer(module)
    above = sorted(i for i in _imports(MODULES[module]) if _layer(i) > own)
    assert above == [], f"{module} (layer {LAYERS[own] if own < len(LAYERS) else own}) imports {above}"


def test_nothing_in_the_library_imports_a_tool():
    tools = LAYERS.index("tools")
    offenders = sorted((m, i) for m, i in GRAPH.edges if _layer(i) == tools and _layer(m) < tools
                       and m != "jax_blink.__main__")
    assert offenders == []


def test_no_import_circle():
    cycles = list(nx.simple_cycles(GRAPH))
    assert cycles == [], f"import circles: {cycles}"


def test_planning_needs_no_jax():
    # Module level only: Topology.discover() without devices asks jax for them, inside the call.
    for module, path in MODULES.items():
        if module.startswith("jax_blink.planning"):
            top = ast.parse(path.read_text()).body
            names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
            names |= {(n.module or "").split(".")[0] for n in top if isinstance(n, ast.ImportFrom)}
            assert "jax" not in names and "jaxlib" not in names, module


def test_the_scan_sees_imports_inside_functions():
    # A circle hidden by a lazy import must still be seen, and relative imports resolved.
    source = "def f():\n    from jax_blink.tools import bench\n    from ..api import collectives\n"
    assert _imports_of(source, "jax_blink.lowering.x", False) == {"jax_blink.tools.bench",
                                                                  "jax_blink.api.collectives"}


def test_importing_jax_blink_loads_no_tool():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    code = "import sys, jax_blink\nprint(sorted(m for m in sys.modules if m.startswith('jax_blink.tools')))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
