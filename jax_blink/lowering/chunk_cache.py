"""The cache of tuned pipelining chunks: (device kind, ranks, collective, dtype, size class) ->
chunk bytes, in memory and in a JSON file.

Part of the call path: with ``config.chunk_bytes = "auto"`` every trace reads its chunk here
(:func:`lookup`) and never times anything. The search that fills the cache is a tool,
:func:`jax_blink.tools.autotune.tune_chunk`, which writes here through :func:`store`.

Cache file: ``$JAX_BLINK_TUNING_CACHE``, by default ``~/.cache/jax_blink/chunks.json``.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import warnings

import jax.numpy as jnp

from jax_blink.options import env_value
from jax_blink.planning.schedule import ALIGN_BYTES

CACHE_ENV = "JAX_BLINK_TUNING_CACHE"
_FORMAT = 1


Key = tuple[str, int, str, str, int]
_FIELDS = ("device_kind", "nranks", "collective", "dtype", "size_class")

_lock = threading.Lock()
_entries: dict[Key, int] = {}
_loaded_from: str | None = None


def cache_path() -> str:
    """Where the cache file is: ``$JAX_BLINK_TUNING_CACHE`` or ``~/.cache/jax_blink/chunks.json``."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "jax_blink", "chunks.json")
    return env_value(CACHE_ENV, os.path.expanduser, "a file path", default=default)


def size_class(nbytes: int) -> int:
    """Sizes within a factor of two share a tuned chunk: the class is ``nbytes.bit_length()``."""
    return int(nbytes).bit_length()


def key(device_kind: str, nranks: int, collective: str, dtype, nbytes: int) -> Key:
    """The cache key of a call. ``nbytes``: the bytes of the operand the schedule covers, per rank
    (for ``allgather`` the gathered buffer, ``n`` times the input)."""
    return (str(device_kind), int(nranks), str(collective), jnp.dtype(dtype).name, size_class(nbytes))


def _read(path: str) -> dict[Key, int]:
    """The entries of the file at ``path``; a missing file is empty, and so is a corrupt one."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"jax_blink: ignoring the unreadable tuning cache {path}: {e}", RuntimeWarning,
                      stacklevel=3)
        return {}
    out: dict[Key, int] = {}
    entries = doc.get("entries") if isinstance(doc, dict) else None
    for e in entries if isinstance(entries, list) else []:
        try:
            k = (str(e["device_kind"]), int(e["nranks"]), str(e["collective"]), str(e["dtype"]),
                 int(e["size_class"]))
            chunk = int(e["chunk_bytes"])
        except (TypeError, KeyError, ValueError):
            continue  # one bad entry does not spoil the others
        if chunk >= ALIGN_BYTES:
            out[k] = chunk
    return out


def _write(path: str, entries: dict[Key, int]) -> None:
    # Atomic: readers (other processes tracing with "auto") see the old file or the new one.
    doc = {"format": _FORMAT, "entries": [dict(zip(_FIELDS, k), chunk_bytes=v)
                                          for k, v in sorted(entries.items())]}
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".chunks-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        warnings.warn(f"jax_blink: could not write the tuning cache {path} ({e}); the tuned chunk "
                      "is kept in memory only", RuntimeWarning, stacklevel=3)


def _loaded() -> dict[Key, int]:
    # Lazily, and again when the path changes (the environment variable was set after a lookup).
    global _entries, _loaded_from
    path = cache_path()
    if _loaded_from != path:
        _entries, _loaded_from = _read(path), path
    return _entries


def lookup(device_kind: str | None, nranks: int, collective: str, dtype, nbytes: int) -> int | None:
    """The tuned chunk (bytes) of this call's class, or None where nothing was tuned for it."""
    if device_kind is None:
        return None
    with _lock:
        return _loaded().get(key(device_kind, nranks, collective, dtype, nbytes))


def store(device_kind: str, nranks: int, collective: str, dtype, nbytes: int, chunk_bytes: int) -> None:
    """Remember ``chunk_bytes`` for this call's class, in memory and in the cache file (merged with
    what other processes wrote there since it was loaded)."""
    if int(chunk_bytes) < ALIGN_BYTES:
        raise ValueError(f"chunk_bytes must be >= {ALIGN_BYTES}, got {chunk_bytes}")
    global _entries
    k = key(device_kind, nranks, collective, dtype, nbytes)
    with _lock:
        path = cache_path()
        # The file's entries win over older ones in memory; ours are kept where the file lacks them.
        merged = {**_loaded(), **_read(path), k: int(chunk_bytes)}
        _entries = merged
        _write(path, merged)


def reload() -> None:
    """Forget the entries in memory: the next lookup reads the file again."""
    global _loaded_from
    with _lock:
        _loaded_from = None
