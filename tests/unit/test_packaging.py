"""How jax_blink is packaged (issue 30), checked without building: the cuda13 extra, the jax that an
isolated build compiles against, the CUDA runtime linked in, pip's CUDA compiler found by the
build, CI's wheel smoke test, and the GPU machine's wheel check bounding every step in time."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CMAKE = (ROOT / "CMakeLists.txt").read_text()
GPU_DOC = (ROOT / "docs" / "gpu.md").read_text()
WHEEL_CHECK = ROOT / "benchmarks" / "gpu_wheel_check.sh"

#: The wheels that make pip's CUDA 13 compiler (nvidia/cu13 in site-packages): nvcc and what it needs.
PIP_TOOLKIT = ("nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cuda-crt", "nvidia-nvvm")


def _jax_dependency() -> Requirement:
    (jax,) = [r for r in map(Requirement, PYPROJECT["project"]["dependencies"]) if r.name == "jax"]
    return jax


def test_cuda13_extra_pulls_jax_cuda13_over_the_supported_range():
    extra = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["cuda13"]]
    (jax,) = [r for r in extra if r.name == "jax"]
    assert jax.extras == {"cuda13"}
    assert jax.specifier == _jax_dependency().specifier


def test_an_isolated_build_compiles_against_the_oldest_supported_jax():
    # XLA refuses a handler of a newer FFI API than its own and takes an older one: the oldest
    # supported jax gives a build that every supported jax runs, on every Python the package takes.
    oldest = min(s.version for s in _jax_dependency().specifier if s.operator == ">=")
    pins = [Requirement(r) for r in PYPROJECT["build-system"]["requires"] if Requirement(r).name == "jax"]
    for python in ("3.11", "3.12", "3.13", "3.14"):
        env = {"python_version": python, "python_full_version": python + ".0"}
        applying = [r for r in pins if r.marker is None or r.marker.evaluate(env)]
        assert len(applying) == 1, f"Python {python}: {len(applying)} jax pins in the build requirements"
        (spec,) = applying[0].specifier
        assert spec.operator == "==" and Version(spec.version) == Version(oldest), (python, str(spec))
    assert Marker("python_version >= '3.11'").evaluate({"python_version": "3.11"})  # the markers above parse


def test_the_cuda_executor_links_the_cuda_runtime_statically():
    links = re.findall(r"target_link_libraries\((\w+)[^)]*\)", CMAKE)
    assert "_blink_cuda" in links
    cuda_libs = set(re.findall(r"CUDA::(\w+)", CMAKE))
    assert "cudart_static" in cuda_libs and "cudart" not in cuda_libs, cuda_libs


def test_a_built_cuda_module_needs_no_cuda_library():
    spec = importlib.util.find_spec("jax_blink._blink_cuda")
    if spec is None or spec.origin is None:
        pytest.skip("this build has no CUDA executor")
    if shutil.which("objdump") is None:
        pytest.skip("no objdump here to read the module's NEEDED entries")
    dump = subprocess.run(["objdump", "-p", spec.origin], capture_output=True, text=True, timeout=60,
                          check=True).stdout
    needed = re.findall(r"NEEDED\s+(\S+)", dump)
    assert needed and "libc.so.6" in needed  # the scan reads the entries
    assert [n for n in needed if "cuda" in n or "nv" in n] == [], needed


def test_the_build_looks_for_pips_cuda_compiler_and_names_its_wheels():
    assert "cu13/bin/nvcc" in CMAKE
    for wheel in PIP_TOOLKIT:
        assert wheel in CMAKE, f"CMakeLists.txt does not name {wheel} in its advice"
    # The guide's install line for pip's compiler names the same wheels as the build's advice.
    (line,) = [ln for ln in GPU_DOC.splitlines() if ln.startswith("python -m pip install nvidia-cuda-nvcc")]
    assert set(re.findall(r"nvidia-[a-z-]+", line)) == set(PIP_TOOLKIT)


def test_ci_builds_the_wheel_and_smoke_tests_it_in_a_fresh_environment():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip wheel" in ci and "auditwheel repair" in ci
    assert "wheel_smoke.py" in ci and "jax-blink\" env" in ci
    assert "python -m pytest -q\n" in ci  # the README's test command still runs
    assert (ROOT / "tests" / "helpers" / "wheel_smoke.py").exists()


def _commands(script: str) -> list[str]:
    """The script's lines that run a Python or jax-blink (comments and heredocs skipped)."""
    out, in_heredoc = [], False
    for line in script.splitlines():
        stripped = line.strip()
        if in_heredoc:
            in_heredoc = stripped != "EOF"
            continue
        if "<<'EOF'" in line:
            in_heredoc = True
        if stripped.startswith("#"):
            continue
        if re.search(r'(/bin/python"?|"\$PY") |/bin/jax-blink"', line):
            out.append(line)
    return out


def test_the_gpu_wheel_check_bounds_every_step_in_time():
    if shutil.which("bash") is None:
        pytest.skip("no bash here")
    subprocess.run(["bash", "-n", str(WHEEL_CHECK)], check=True, timeout=30)
    commands = _commands(WHEEL_CHECK.read_text())
    assert len(commands) >= 10  # the scan sees the wheel build, installs, smoke tests and pytest
    unbounded = [c.strip() for c in commands if "timeout " not in c]
    assert unbounded == [], "every step of benchmarks/gpu_wheel_check.sh runs under timeout"


def test_the_gpu_wheel_check_refuses_an_unknown_step(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash here")
    run = subprocess.run(["bash", str(WHEEL_CHECK)], cwd=ROOT, env={"STEPS": "wheel instal", "PATH": "/usr/bin:/bin",
                         "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "unknown step 'instal'" in run.stderr
    assert not (tmp_path / "wheel_check").exists()  # refused before anything ran
