"""The user's own dispatch entries: what ``jax-blink tune`` measured on this machine, in a JSON
file of the user's cache, with the bench files they were derived from beside it.

Part of the call path: with ``dispatch="auto"`` every trace asks :func:`lookup` for an entry of
this very machine (device model, count, links, layout, jax and NCCL versions:
:class:`jax_blink.lowering.machine.MachineKey`) before the shipped table. The tool that fills the
cache is :mod:`jax_blink.tools.tune`, which writes through :func:`store`.

Folder: ``$JAX_BLINK_DISPATCH_CACHE``, else ``$XDG_CACHE_HOME/jax_blink``, else
``~/.cache/jax_blink``; the entries are ``dispatch.json`` there and the bench runs ``bench/*.json``.
"""
from __future__ import annotations

import os
import threading
import warnings

from jax_blink.lowering import dispatch_table
from jax_blink.lowering.dispatch_table import Crossover
from jax_blink.lowering.machine import MachineKey
from jax_blink.options import env_value

CACHE_ENV = "JAX_BLINK_DISPATCH_CACHE"
FILE_NAME = "dispatch.json"
BENCH_FOLDER = "bench"

_lock = threading.Lock()
_read_cache: dict[str, tuple[float, tuple[Crossover, ...]]] = {}
_warned: set[str] = set()


def cache_dir(folder: str | None = None) -> str:
    """The cache folder: ``folder`` if given, else ``$JAX_BLINK_DISPATCH_CACHE``, else
    ``$XDG_CACHE_HOME/jax_blink``, else ``~/.cache/jax_blink``."""
    if folder:
        return os.path.abspath(os.path.expanduser(folder))
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    default = os.path.join(os.path.expanduser(xdg) if xdg else os.path.join(os.path.expanduser("~"), ".cache"),
                           "jax_blink")
    return os.path.abspath(env_value(CACHE_ENV, os.path.expanduser, "a folder path", default=default))


def cache_file(folder: str | None = None) -> str:
    """The entries file in the cache folder (:func:`cache_dir`)."""
    return os.path.join(cache_dir(folder), FILE_NAME)


def entries(folder: str | None = None) -> tuple[Crossover, ...]:
    """Every entry of the cache (empty when there is no file; a file that cannot be read is
    ignored with one warning naming it)."""
    path = cache_file(folder)
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return ()
    with _lock:
        hit = _read_cache.get(path)
        if hit is not None and hit[0] == mtime:
            return hit[1]
    try:
        found = dispatch_table.read_entries(path)
    except ValueError as e:
        if path not in _warned:
            _warned.add(path)
            warnings.warn(f"jax_blink: ignoring the dispatch cache: {e}", RuntimeWarning, stacklevel=3)
        found = ()
    with _lock:
        _read_cache[path] = (mtime, found)
    return found


def matches(c: Crossover, key: MachineKey) -> bool:
    """Whether the cached entry ``c`` was measured on the machine ``key``: the same device model,
    count, links and layout, under the same jax and NCCL versions."""
    return (c.device_kind, c.ranks, c.links, c.layout, c.jax, c.nccl) == (
        key.device_kind, key.ranks, key.links, key.layout, key.jax, key.nccl)


def for_machine(key: MachineKey, folder: str | None = None) -> tuple[Crossover, ...]:
    """The cached entries of the machine ``key``."""
    return tuple(c for c in entries(folder) if matches(c, key))


def lookup(key: MachineKey, collective: str, dtype: str | None, folder: str | None = None) -> Crossover | None:
    """The cached entry for ``collective`` in ``dtype`` on the machine ``key`` (None: not tuned)."""
    mine = for_machine(key, folder)
    if not mine:
        return None
    return dispatch_table.entry(key.device_kind, key.ranks, collective, key.layout, dtype, key.links, table=mine)


def store(new: list[Crossover], folder: str | None = None) -> tuple[str, list[Crossover]]:
    """Put ``new`` into the cache in place of the entries of the same machines (versions
    included), collectives and layouts; ``(file written, entries replaced)``."""
    path = cache_file(folder)
    old = list(entries(folder)) if os.path.exists(path) else []
    keys = {(c.group, c.jax, c.nccl) for c in new}
    replaced = [c for c in old if (c.group, c.jax, c.nccl) in keys]
    kept = [c for c in old if (c.group, c.jax, c.nccl) not in keys]
    dispatch_table.write_entries(path, kept + list(new),
                                 "jax_blink dispatch entries measured on this machine by `jax-blink tune`, each "
                                 f"derived from the bench files it cites (in {BENCH_FOLDER}/ beside this file)")
    with _lock:
        _read_cache.pop(path, None)
    return path, replaced
