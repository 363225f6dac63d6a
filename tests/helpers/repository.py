"""The repository's own files, for tests that read them: what git tracks (a virtual environment or a
build inside the checkout is not the repository's), else, without git or a .git (a copied tree), a
walk that skips build, cache and environment folders (any folder holding a ``pyvenv.cfg``)."""
from __future__ import annotations

import fnmatch
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"_build", ".git", ".venv", "venv", "env", "build", ".hypothesis", ".pytest_cache",
             "__pycache__", ".whl"}


def repository_files(root: Path = ROOT, pattern: str | None = None) -> list[Path]:
    """The repository's files under ``root``, sorted; with ``pattern`` (e.g. ``"examples/*.py"``,
    relative to ``root``) only those it matches."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True,
                               text=True, timeout=60).stdout.split("\0")
        files = [root / n for n in names if n and (root / n).is_file()]
    except (OSError, subprocess.SubprocessError):
        envs = {p.parent for p in root.rglob("pyvenv.cfg")}
        files = [p for p in root.rglob("*") if p.is_file() and not SKIP_DIRS & set(p.relative_to(root).parts)
                 and not any(p.is_relative_to(e) for e in envs)]
    if pattern is not None:
        files = [p for p in files if fnmatch.fnmatch(p.relative_to(root).as_posix(), pattern)]
    return sorted(files)
