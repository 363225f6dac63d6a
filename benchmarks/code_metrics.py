"""Lines per module, the longest functions and the import graph of the jax_blink package at a git
revision (default: the working tree), for comparing the house before and after a change.

    python benchmarks/code_metrics.py [--rev REV] [--top 10]
"""
from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _files(rev: str | None) -> dict[str, str]:
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "jax_blink").rglob("*.py")}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "jax_blink/"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout for n in names if n.endswith(".py")}


def _module(path: str) -> str:
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(module: str, is_pkg: bool, source: str, known: set[str]) -> set[str]:
    package = module if is_pkg else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
            named = {f"{name}.{a.name}" for a in node.names} & known
            out |= named or ({name} & known)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names} & known
    out.discard(module)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", help="a git revision (default: the working tree)")
    ap.add_argument("--top", type=int, default=10, help="how many of the longest functions to list")
    a = ap.parse_args()
    if a.top < 1:
        ap.error(f"--top: got {a.top}; takes a count >= 1")
    if a.rev is not None and subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{a.rev}^{{commit}}"],
                                            cwd=ROOT, capture_output=True).returncode != 0:
        ap.error(f"--rev: got {a.rev!r}; takes a git revision of this repository (a commit, branch or tag)")
    files = _files(a.rev)
    known = {_module(p) for p in files}
    print(f"{len(files)} modules, {sum(s.count(chr(10)) for s in files.values())} lines")
    print("\nlines per module:")
    for path, src in sorted(files.items(), key=lambda kv: -kv[1].count("\n")):
        print(f"  {src.count(chr(10)):5d}  {path}")
    funcs = []
    for path, src in files.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}"))
    print(f"\nthe {a.top} longest functions (lines):")
    for n, where in sorted(funcs, reverse=True)[: a.top]:
        print(f"  {n:5d}  {where}")
    edges = {m: _imports(m, p.endswith("__init__.py"), files[p], known) for p in files for m in [_module(p)]}
    import networkx as nx

    g = nx.DiGraph([(m, i) for m, deps in edges.items() for i in deps])
    cycles = list(nx.simple_cycles(g))
    print(f"\nimport graph: {g.number_of_nodes()} modules, {g.number_of_edges()} imports "
          f"(inside functions too), {len(cycles)} circle(s){': ' + str(cycles) if cycles else ''}")
    for m in sorted(edges):
        if edges[m]:
            print(f"  {m} -> {', '.join(sorted(edges[m]))}")


if __name__ == "__main__":
    main()
