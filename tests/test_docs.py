"""The documents tell the truth about the repository:

* every ```python block of README.md runs, as written, in a fresh interpreter on 8 CPU host devices
  and prints something (a block that needs GPUs says so on its first line, ``# needs: gpu``, and
  is skipped without them; a ``# needs: launcher`` block is a program started once per process,
  ``python prog.py PROCESS_ID NUM_PROCESSES``: it runs here as a job of 2 processes of 2 host devices);
* every file a document cites (README.md, docs/DESIGN.md) exists;
* nothing in the repository points outside it (the design document is docs/DESIGN.md);
* the README documents every environment variable the package and the executors read.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "DESIGN.md"
N_HOST_DEVICES = 8

# ---------------------------------------------------------------------------------------------
# README blocks

# The first line of a block that cannot run on 8 CPU host devices says what it needs.
NEEDS = re.compile(r"#\s*needs:\s*(\S+)")
KNOWN_NEEDS = {"gpu": "needs GPUs", "launcher": "needs a multi-process launcher"}


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, what it needs or None) of every ```python block of a Markdown text."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"line {start}: a ```python block that never closes")
            m = NEEDS.match(body[0].strip()) if body else None
            out.append((start, "\n".join(body) + "\n", m.group(1) if m else None))
        i += 1
    return out


def test_block_extraction_reads_markers_and_fences():
    text = "x\n```python\nprint(1)\n```\n```bash\nls\n```\n```python\n# needs: gpu\nprint(2)\n```\n"
    assert python_blocks(text) == [(2, "print(1)\n", None), (8, "# needs: gpu\nprint(2)\n", "gpu")]
    with pytest.raises(ValueError, match="never closes"):
        python_blocks("```python\nprint(1)\n")


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_runnable_blocks_and_few_exceptions():
    assert len(BLOCKS) >= 2
    assert all(needs in KNOWN_NEEDS for _, _, needs in BLOCKS if needs), "unknown '# needs:' marker"
    # Exceptions stay rare: most of what a newcomer reads runs on any machine.
    assert sum(1 for *_, needs in BLOCKS if needs) <= len(BLOCKS) // 3


def _host_device_env() -> dict[str, str]:
    """The tests' environment (conftest.py) for a fresh interpreter: 8 CPU host devices, no GPU,
    no JAX_BLINK_* settings of whoever runs the tests, this checkout importable, no display."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_BLINK_")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={N_HOST_DEVICES}"])
    env.setdefault("PJRT_NPROC", "16")
    env["JAX_PLATFORMS"] = "cpu"
    env["MPLBACKEND"] = "Agg"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _block_param(line, code, needs):
    marks = [pytest.mark.gpu] if needs == "gpu" else []
    return pytest.param(line, code, needs, marks=marks, id=f"README.md:{line}" + (f"[{needs}]" if needs else ""))


@pytest.mark.parametrize("line,code,needs", [_block_param(*b) for b in BLOCKS])
def test_readme_block_runs(line, code, needs, tmp_path):
    env = _host_device_env()
    if needs == "launcher":
        _run_as_job(line, code, env, tmp_path)
        return
    if needs == "gpu":
        del env["JAX_PLATFORMS"]
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"README.md block at line {line} failed:\n{out.stdout}\n{out.stderr}"
    assert out.stdout.strip(), f"README.md block at line {line} prints nothing: show the result"


def _run_as_job(line, code, env, tmp_path, nprocs: int = 2) -> None:
    """Run a launcher block as the README launches it: ``nprocs`` processes of 2 host devices,
    ``prog.py PROCESS_ID NUM_PROCESSES``, on a free loopback port (the block's 12345 replaced)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert "127.0.0.1:12345" in code, f"README.md line {line}: a launcher block starts its job on 127.0.0.1:12345"
    prog = tmp_path / "prog.py"
    prog.write_text(code.replace("127.0.0.1:12345", f"127.0.0.1:{port}"))
    env = dict(env, XLA_FLAGS=env["XLA_FLAGS"].replace(f"count={N_HOST_DEVICES}", "count=2"))
    procs = [subprocess.Popen([sys.executable, str(prog), str(i), str(nprocs)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for i in range(nprocs)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240))
    finally:
        for p in procs:  # a process left waiting for a dead peer is killed with its group
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"README.md block at line {line}, process {i} failed:\n{out}\n{err}"
        assert out.strip(), f"README.md block at line {line}, process {i} prints nothing"


# ---------------------------------------------------------------------------------------------
# Cited files

# A word cited as a path: relative to the repository root, starting at one of its folders or files.
_TOP = ("jax_blink/", "kernels/", "benchmarks/", "notebooks/", "tests/", "docs/", ".ci/")
_TOP_FILES = ("README.md", "pyproject.toml", "CMakeLists.txt")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)


def _expand_braces(word: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    return [w for alt in m.group(1).split(",") for w in _expand_braces(word[:m.start()] + alt + word[m.end():])]


def cited_paths(text: str, doc: Path) -> list[tuple[str, list[Path]]]:
    """(as cited, candidate paths) for every relative link of a Markdown text and every word in its
    code spans and blocks that names a path of the repository (globs and {a,b} allowed)."""
    out = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor
        out.append((target, [(doc.parent / target.split("#")[0]).resolve()]))
    for block, span in _CODE.findall(text):
        for word in (block or span).split():
            word = word.strip("\"'(),;:.")
            if word.startswith(_TOP) or word in _TOP_FILES:
                out.append((word, [ROOT / w for w in _expand_braces(word)]))
    return out


def _missing(cited: list[tuple[str, list[Path]]]) -> list[str]:
    bad = []
    for word, paths in cited:
        for p in paths:
            rel = p.relative_to(ROOT) if p.is_relative_to(ROOT) else None
            found = (list(ROOT.glob(str(rel))) if rel is not None and any(c in str(rel) for c in "*?[")
                     else [p] if p.exists() else [])
            if not found:
                bad.append(f"{word} ({p})")
    return bad


def test_the_citation_check_can_fail(tmp_path):
    doc = ROOT / "README.md"
    text = ("see [the notes](benchmarks/NOTES.md), `jax_blink/nothing_here.py`, "
            "`benchmarks/results/allreduce-*-v0.4.{csv,nope}` and [web](https://example.com)")
    cited = cited_paths(text, doc)
    assert [w for w, _ in cited] == ["benchmarks/NOTES.md", "jax_blink/nothing_here.py",
                                     "benchmarks/results/allreduce-*-v0.4.{csv,nope}"]
    missing = _missing(cited)
    assert len(missing) == 2 and "nothing_here" in missing[0] and "v0.4.nope" in missing[1]


@pytest.mark.parametrize("doc", [README, DESIGN], ids=["README.md", "docs/DESIGN.md"])
def test_every_cited_file_exists(doc):
    assert doc.exists()
    cited = cited_paths(doc.read_text(), doc)
    assert len(cited) >= 5  # the scan sees the citations
    assert _missing(cited) == []


# ---------------------------------------------------------------------------------------------
# Nothing points outside the repository

_SKIP_DIRS = {".git", ".venv", "build", ".hypothesis", ".pytest_cache", "__pycache__", ".whl"}
_TEXT = {".py", ".md", ".ipynb", ".txt", ".sh", ".cu", ".cc", ".h", ".cuh", ".toml", ".cfg", ".yml",
         ".yaml", ".json", ".csv", ""}


def _repository_text_files():
    """The repository's files: tracked and untracked but not ignored (git), else a walk that skips
    the usual build and cache folders."""
    try:
        names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                               capture_output=True, text=True, timeout=60).stdout.splitlines()
        paths = [ROOT / n for n in names]
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in ROOT.rglob("*") if not _SKIP_DIRS & set(p.relative_to(ROOT).parts)]
    return [p for p in paths if p.is_file() and p.suffix in _TEXT]


def test_nothing_points_outside_the_repository():
    bad = []
    for path in _repository_text_files():
        if path == Path(__file__):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for m in re.finditer(r"\.\./shared|/work/|(?<![\w/])DESIGN\.md", text):
            if m.group() == "DESIGN.md" and path.parent == ROOT / "docs":
                continue  # docs/ may name itself
            bad.append(f"{path.relative_to(ROOT)}: ...{text[max(0, m.start() - 40):m.end() + 10]!r}")
    assert bad == [], "cite the design document as docs/DESIGN.md, nothing outside the repository"


# ---------------------------------------------------------------------------------------------
# Environment variables

def test_every_environment_variable_is_in_the_readme():
    sources = [*ROOT.glob("jax_blink/*.py"), *ROOT.glob("kernels/**/*.c*"), *ROOT.glob("kernels/**/*.h")]
    names, macros = set(), set()
    for path in sources:
        text = path.read_text()
        names |= set(re.findall(r"\bJAX_BLINK_[A-Z0-9_]+\b", text))
        macros |= set(re.findall(r"#define\s+(JAX_BLINK_[A-Z0-9_]+)", text))
    names -= macros
    assert "JAX_BLINK_ONESHOT_BYTES" in names and "JAX_BLINK_DISPATCH" in names  # the scan works
    readme = README.read_text()
    assert sorted(n for n in names if n not in readme) == []
