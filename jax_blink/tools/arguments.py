"""What the command-line tools (``python -m jax_blink ...``, ``python -m jax_blink.tools.bench``) share:
argument types that check a value when it is parsed, and the one-line usage error.

Every bad value ends the same way before any work starts: one line on stderr that names the
option, what it got and what it takes, and exit status 2. Argument types raise
``argparse.ArgumentTypeError`` (argparse prefixes the option's name); checks that need several
options or the devices raise :class:`UsageError` through :func:`bad`.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from jax_blink.options.settings import parse_byte_count

#: What a size option takes, said the same way by every tool.
BYTE_COUNT = "bytes per rank such as 65536, 512K, 16M or 1G (K, M, G: binary units)"
N_HOST_DEVICES = 8


class UsageError(Exception):
    """Bad command-line input: reported as one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (raised as :class:`UsageError`), not usage text,
    and whose options take values that start with ``-`` (``--size -4M`` reaches the option's own
    check, which says what it takes, instead of argparse's "expected one argument")."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._join_dash_values(args), namespace)

    def _join_dash_values(self, args: list[str]) -> list[str]:
        """``--opt -x`` -> ``--opt=-x`` (``-o -x`` -> ``-o-x``) for options that take one value,
        where ``-x`` is no option of this parser; everything after ``--`` is left alone."""
        takes_one = {s for a in self._actions if a.nargs is None and a.option_strings
                     for s in a.option_strings}
        out: list[str] = []
        i = 0
        while i < len(args):
            a = args[i]
            if a == "--" or a in self._name_parser_map():  # the rest: literal, or a subcommand's own
                return out + args[i:]
            nxt = args[i + 1] if i + 1 < len(args) else None
            if (a in takes_one and nxt is not None and nxt.startswith("-") and nxt != "--"
                    and nxt.split("=")[0] not in self._option_string_actions):
                out.append(f"{a}={nxt}" if a.startswith("--") else a + nxt)
                i += 2
                continue
            out.append(a)
            i += 1
        return out

    def _name_parser_map(self) -> dict:
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                return a._name_parser_map
        return {}


def bad(option: str, value, takes: str) -> UsageError:
    """The usage error for ``option``: what it got and what it takes."""
    return UsageError(f"argument {option}: got {value!r}; {takes}")


def run_main(prog: str, body: Callable[[], int],
             usage_errors: tuple[type[Exception], ...] = (UsageError, ValueError)) -> int:
    """Run a tool's ``body``; a :class:`UsageError` (and by default a ValueError: the library says
    what is wrong with the input that way) becomes one line on stderr and exit status 2; ``--help``
    exits 0; output piped into ``head`` ends quietly."""
    try:
        return int(body() or 0)
    except usage_errors as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)  # one line, always
        return 2
    except BrokenPipeError:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (stays open until exit)
        return 0
    except SystemExit as e:  # --help, or a tool's own exit
        if isinstance(e.code, str):
            print(f"{prog}: error: {e.code}", file=sys.stderr)
            return 2
        return int(e.code or 0)


def ensure_host_devices(n: int = N_HOST_DEVICES) -> str:
    """Ask XLA for ``n`` CPU host devices if JAX has not started its backends yet and nobody asked
    already (on a GPU machine the flag changes nothing: the GPUs are the default devices).

    Args:
        n: CPU host devices to ask for.

    Returns:
        What was done, in words, for the tools to print on a machine without GPUs.
    """
    # The package imports jax, but XLA reads its flags only when the first backend starts.
    try:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            return "JAX had started before the tool could set XLA_FLAGS"
    except (ImportError, AttributeError):
        return "XLA_FLAGS left as it is (this jax does not say whether its backends started)"
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ.setdefault("PJRT_NPROC", "16")  # DESIGN: avoids a deadlock of back-to-back launches
    if "--xla_force_host_platform_device_count" in flags:
        return "the device count is the one XLA_FLAGS already set"
    flag = f"--xla_force_host_platform_device_count={n}"
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    return f"this tool set XLA_FLAGS={flag} before JAX started (without it JAX gives one CPU device)"


# ------------------------------------------------------------------------------ argument types
def byte_count(text: str) -> int:
    """A size option: bytes per rank in the byte-count grammar, > 0."""
    try:
        value = parse_byte_count(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; takes {BYTE_COUNT}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"got {text!r}; takes {BYTE_COUNT}, at least 1")
    return value


def whole_number(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer option in ``[lo, hi]``."""
    span = f">= {lo}" if hi is None else f"from {lo} to {hi}"

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; takes a whole number {span}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"got {text!r}; takes a whole number {span}")
        return value

    return parse


def number(lo: float, *, above: bool = False, unit: str = "") -> Callable[[str], float]:
    """A finite decimal option, ``>= lo`` (``> lo`` with ``above``)."""
    span = f"{'>' if above else '>='} {lo:g}{unit}"

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < lo or (above and value == lo):
            raise argparse.ArgumentTypeError(f"got {text!r}; takes a finite number {span}")
        return value

    return parse


# ------------------------------------------------------------------------------ paths
def _probe(option: str, folder: Path, what: str) -> None:
    """Write and remove a scratch file in ``folder``: the one test of writability that also holds
    for root and for read-only file systems (``os.access`` says yes to root almost everywhere)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise bad(option, what, f"cannot write into {str(folder)!r} ({e.strerror or e}); "
                                "choose another path") from None


def picture_path(option: str, text: str) -> str:
    """A file to draw into, checked before any work so that a plot never fails last: not a folder,
    its folder exists, its suffix names a format matplotlib writes (:func:`jax_blink.tools.draw.check_path`),
    and a scratch file can be written there."""
    from jax_blink.tools.draw import check_path

    p = Path(text)
    if not text.strip() or p.is_dir():
        raise bad(option, text, "takes a picture file name such as trees.png (not a folder)")
    try:
        check_path(p)
    except (OSError, ValueError) as e:  # its message: "cannot write the picture ...: why; what to do"
        raise bad(option, text, str(e).removeprefix(f"cannot write the picture {str(p)!r}: ")) from None
    _probe(option, p.parent, text)
    return text


def output_folder(option: str, text: str) -> str:
    """A folder for result files: an existing folder we can write into, or a new one whose parent
    is a folder we can write into (the tool makes it when it writes, so that a run refused for
    another option leaves nothing behind). A path whose parent is missing is refused: a mistyped
    path must not become a tree of new folders.

    Args:
        option: the option's name, for the message.
        text: the path given.

    Returns:
        ``text``, checked.

    Raises:
        UsageError: naming the option, the path and what is wrong with it.
    """
    if not text.strip():
        raise bad(option, text, "takes a folder name")
    p = Path(text)
    if p.exists():
        if not p.is_dir():
            raise bad(option, text, "takes a folder; this is a file")
        _probe(option, p, text)
        return text
    parent = p.absolute().parent
    if not parent.exists():
        blocker = next((f for f in parent.parents if f.exists() and not f.is_dir()), None)
        if blocker is not None:
            raise bad(option, text, f"the folder cannot be made: {str(blocker)!r} is a file")
        raise bad(option, text, f"its parent folder {str(parent)!r} does not exist; make it first "
                                "(only the last folder of the path is made) or choose another")
    if not parent.is_dir():
        raise bad(option, text, f"the folder cannot be made: {str(parent)!r} is a file")
    _probe(option, parent, text)
    return text


def input_file(option: str, text: str, *, suffix: str | None = None) -> str:
    """A file to read: it exists, is a file, is readable (and ends in ``suffix`` if given)."""
    p = Path(text)
    if suffix and p.suffix.lower() != suffix:
        raise bad(option, text, f"takes a {suffix} file")
    if not p.is_file():
        raise bad(option, text, "no such file" if not p.exists() else "takes a file, not a folder")
    if not os.access(p, os.R_OK):
        raise bad(option, text, "the file is not readable")
    return text


# ------------------------------------------------------------------------------ memory
def available_memory(devices: Sequence) -> tuple[int | None, str]:
    """Bytes one device of ``devices`` can hold and what that is: on CPU host devices the host
    memory available now (all devices share it), on GPUs a device's memory limit; None if unknown."""
    if devices and devices[0].platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, "host memory available now"
        except OSError:
            pass
        return None, ""
    try:
        limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 (a backend without memory stats: nothing to check)
        limit = None
    return (int(limit), "memory of one device") if limit else (None, "")


def check_fits(option: str, value: int, devices: Sequence, bytes_needed: int) -> None:
    """Refuse ``option`` = ``value`` bytes per rank when the run needs more memory than there is
    (``bytes_needed``: on CPU host devices for all of them, on GPUs for one)."""
    have, what = available_memory(devices)
    if have is not None and bytes_needed > have:
        raise bad(option, _fmt(value), f"this run needs about {_fmt(bytes_needed)} bytes and the "
                                       f"{what} is {_fmt(have)}; take a smaller size")


def _fmt(nbytes: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift:
            v = nbytes / (1 << shift)
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return str(nbytes)


def format_bytes(nbytes: int) -> str:
    """``nbytes`` as a short size for messages: 512, 1.5K, 64M, 2G (binary units)."""
    return _fmt(nbytes)
