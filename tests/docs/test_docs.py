"""The documents tell the truth about the repository:

* every ```python block of README.md and of the docs pages (docs/*.md) runs, as written, in a fresh
  interpreter with no ``XLA_FLAGS`` preset, and prints something; a block that runs a collective
  (it names ``shard_map`` or ``pmap``) gives itself 8 CPU host devices before jax starts, as a user
  on a machine without a GPU needs, and the program it compiles holds jax_blink's custom call
  (``jax_blink_collective``, read from the StableHLO that jax dumps). A block that needs GPUs says so
  on its first line, ``# needs: gpu``, and is skipped without them; a ``# needs: launcher`` block is
  a program started once per process, ``python prog.py PROCESS_ID NUM_PROCESSES``: it runs here as
  a job of 2 processes of 2 host devices;
* every file a document cites exists;
* nothing in the repository points outside it (the design document is docs/DESIGN.md);
* the options page documents, in its one table, every environment variable the package and the
  executors read;
* the repository-file walks read what git tracks, so a virtual environment inside the checkout
  changes nothing.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from repository import repository_files  # noqa: E402  (tests/helpers: not a package)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "DESIGN.md"
OPTIONS = ROOT / "docs" / "options.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
CUSTOM_CALL = "jax_blink_collective"
# What a block that runs a collective writes before it imports jax (README.md's first program).
HOST_DEVICES_LINE = 'os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")'

# ---------------------------------------------------------------------------------------------
# Code blocks

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


def _rel(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


BLOCKS = [(_rel(doc), line, code, needs) for doc in DOCS for line, code, needs in python_blocks(doc.read_text())]


def test_the_documents_have_runnable_blocks_and_few_exceptions():
    assert len([b for b in BLOCKS if b[0] == "README.md"]) >= 2
    assert {doc for doc, *_ in BLOCKS} >= {"README.md", "docs/collectives.md", "docs/switch.md"}
    assert all(needs in KNOWN_NEEDS for *_, needs in BLOCKS if needs), "unknown '# needs:' marker"
    # Exceptions stay rare: most of what a newcomer reads runs on any machine.
    assert sum(1 for *_, needs in BLOCKS if needs) <= len(BLOCKS) // 3


def runs_a_collective(code: str) -> bool:
    """Whether a block runs a collective: it builds a shard_map or pmap."""
    return bool(re.search(r"\bshard_map\b|\bpmap\b", code))


def host_devices_problem(code: str) -> str | None:
    """Why a block that runs a collective would not run jax_blink's executor when a user without a
    GPU runs it as written (None: it would): it must give itself 8 host devices before jax starts."""
    if not runs_a_collective(code):
        return None
    first_jax = re.search(r"^(import jax|from jax)", code, re.M)
    at = code.find(HOST_DEVICES_LINE)
    if at < 0 or (first_jax is not None and at > first_jax.start()):
        return f"a block that runs a collective sets, before it imports jax: {HOST_DEVICES_LINE}"
    return None


def test_the_host_device_rule_can_fail():
    assert host_devices_problem("print(1)\n") is None
    sm = "import jax\nf = jax.shard_map\n"
    assert "before it imports jax" in host_devices_problem(sm)
    assert "before it imports jax" in host_devices_problem(sm + "import os\n" + HOST_DEVICES_LINE + "\n")
    assert host_devices_problem("import os\n" + HOST_DEVICES_LINE + "\n" + sm) is None


def dumped_custom_calls(folder: Path) -> int:
    """How many of the StableHLO modules jax dumped into ``folder`` hold jax_blink's custom call."""
    return sum(1 for f in folder.rglob("*") if f.is_file() and CUSTOM_CALL in f.read_text(errors="replace"))


def _fresh_env(dump: Path) -> dict[str, str]:
    """A fresh interpreter's environment as a user's: no XLA_FLAGS, no JAX_BLINK_* settings of whoever
    runs the tests; CPU (so that the blocks run alike on machines with GPUs), this checkout
    importable, no display; jax dumps every module it lowers into ``dump``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_BLINK_") and k != "XLA_FLAGS"}
    env.setdefault("PJRT_NPROC", "16")
    env["JAX_PLATFORMS"] = "cpu"
    env["MPLBACKEND"] = "Agg"
    env["JAX_DUMP_IR_TO"] = str(dump)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _block_param(doc, line, code, needs):
    marks = [pytest.mark.gpu] if needs == "gpu" else []
    return pytest.param(doc, line, code, needs, marks=marks, id=f"{doc}:{line}" + (f"[{needs}]" if needs else ""))


@pytest.mark.parametrize("doc,line,code,needs", [_block_param(*b) for b in BLOCKS])
def test_block_runs(doc, line, code, needs, tmp_path):
    where = f"{doc} block at line {line}"
    dump = tmp_path / "ir"
    env = _fresh_env(dump)
    if needs == "launcher":
        _run_as_job(where, code, env, tmp_path)
    else:
        problem = host_devices_problem(code)
        assert problem is None, f"{where}: {problem}"
        if needs == "gpu":
            del env["JAX_PLATFORMS"]
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, f"{where} failed:\n{out.stdout}\n{out.stderr}"
        assert out.stdout.strip(), f"{where} prints nothing: show the result"
    if runs_a_collective(code):
        assert dump.exists() and dumped_custom_calls(dump) > 0, (
            f"{where} runs a collective, but no program it compiled holds jax_blink's custom call "
            f"({CUSTOM_CALL}): as written, it does not run jax_blink's executor")


def _run_as_job(where, code, env, tmp_path, nprocs: int = 2) -> None:
    """Run a launcher block as the docs launch it: ``nprocs`` processes of 2 host devices
    (``XLA_FLAGS`` as the launch loop sets it), ``prog.py PROCESS_ID NUM_PROCESSES``, on a free
    loopback port (the block's 12345 replaced)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert "127.0.0.1:12345" in code, f"{where}: a launcher block starts its job on 127.0.0.1:12345"
    prog = tmp_path / "prog.py"
    prog.write_text(code.replace("127.0.0.1:12345", f"127.0.0.1:{port}"))
    env = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=2")
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
        assert p.returncode == 0, f"{where}, process {i} failed:\n{out}\n{err}"
        assert out.strip(), f"{where}, process {i} prints nothing"


# ---------------------------------------------------------------------------------------------
# Cited files

# A word cited as a path: relative to the repository root, starting at one of its folders or files.
_TOP = ("jax_blink/", "kernels/", "benchmarks/", "notebooks/", "tests/", "docs/", ".ci/")
_TOP_FILES = ("README.md", "CHANGELOG.md", "pyproject.toml", "CMakeLists.txt")
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
            word = word.split("::")[0]  # a pytest node id cites its file
            if word.startswith(_TOP) or word in _TOP_FILES:
                out.append((word, [ROOT / w for w in _expand_braces(word)]))
    return out


#: Folders that commands in the docs create (outputs, not sources): citing them is no broken link.
_OUTPUTS = ("docs/_build",)


def _missing(cited: list[tuple[str, list[Path]]]) -> list[str]:
    bad = []
    for word, paths in cited:
        for p in paths:
            rel = p.relative_to(ROOT) if p.is_relative_to(ROOT) else None
            if rel is not None and str(rel).startswith(_OUTPUTS):
                continue
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


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_cited_file_exists(doc):
    assert doc.exists()
    cited = cited_paths(doc.read_text(), doc)
    if doc in (README, DESIGN):
        assert len(cited) >= 5  # the scan sees the citations
    assert _missing(cited) == []


# ---------------------------------------------------------------------------------------------
# Nothing points outside the repository

_TEXT = {".py", ".md", ".ipynb", ".txt", ".sh", ".cu", ".cc", ".h", ".cuh", ".toml", ".cfg", ".yml",
         ".yaml", ".json", ".csv", ""}


def _repository_text_files():
    return [p for p in repository_files() if p.suffix in _TEXT]


def test_the_file_walk_reads_what_git_tracks(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("no git here (the walk then skips environment folders: the test below covers it)")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "kept.md").write_text("tracked")
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (tmp_path / "venv" / "site.py").write_text("../shared")
    subprocess.run(["git", "add", "kept.md"], cwd=tmp_path, check=True)
    assert repository_files(tmp_path) == [tmp_path / "kept.md"]


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

def _read_variables() -> set[str]:
    """Every JAX_BLINK_* variable that the package's or the executors' tracked sources name (the
    executors' own ``#define JAX_BLINK_...`` macros are not variables)."""
    names, macros = set(), set()
    for path in repository_files():
        rel = path.relative_to(ROOT).as_posix()
        if not ((rel.startswith("jax_blink/") and path.suffix == ".py")
                or (rel.startswith("kernels/") and path.suffix in (".cc", ".cu", ".h", ".cuh"))):
            continue
        text = path.read_text()
        names |= set(re.findall(r"\bJAX_BLINK_[A-Z0-9_]+\b", text))
        macros |= set(re.findall(r"#define\s+(JAX_BLINK_[A-Z0-9_]+)", text))
        macros |= {"JAX_BLINK_CUDA_ARCHS"}  # a CMake setting of the build (README, "Building for GPUs"), no variable
    return names - macros


def options_table_rows(text: str) -> dict[str, str]:
    """variable -> its row, for every row of the options page's table that starts with a variable."""
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `(JAX_BLINK_[A-Z0-9_]+)` \|.*$", text, re.M)}


def test_every_environment_variable_is_in_the_options_table():
    from jax_blink.options import KNOWN_ENVIRONMENT
    names = _read_variables()
    assert "JAX_BLINK_ONESHOT_BYTES" in names and "JAX_BLINK_DISPATCH" in names  # the scan works
    rows = options_table_rows(OPTIONS.read_text())
    assert sorted((names | set(KNOWN_ENVIRONMENT)) - set(rows)) == [], "add a row to docs/options.md"
    assert sorted(set(rows) - set(KNOWN_ENVIRONMENT)) == [], "docs/options.md lists a variable nothing reads"
    for name, row in rows.items():  # variable | option | default | takes | what it does
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 5 and all(cells), f"{name}: every column of its row says something"
