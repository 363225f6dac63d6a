"""Where a collective runs: jax_blink's executor or XLA's own collective, and why. The one
decider for explicit calls and the switch alike, and the one place that warns about a fall-back."""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import numpy as np

from jax_blink.lowering import backends as _backends
from jax_blink.lowering import dispatch_cache, dispatch_table
from jax_blink.lowering import machine as _machine
from jax_blink.lowering import hierarchy as _hierarchy
from jax_blink.lowering import processes as _distributed
from jax_blink.lowering.mesh import device_kind, platform as current_platform
from jax_blink.options import config

_warned: set[str] = set()
_no_entry_warned: list[bool] = [False]  # the no-entry warning: once per process


@dataclasses.dataclass(frozen=True)
class Decision:
    """Where one collective runs: ``executor`` is True for jax_blink's executor, False for XLA's
    own collective; ``reason`` says why, in words."""

    executor: bool
    reason: str


#: XLA's collective that each of jax_blink's equals, as the messages name it.
LAX_NAME = {"allreduce": "lax.psum", "broadcast": "lax.psum (of the root's value)",
            "reduce": "lax.psum", "allgather": "lax.all_gather", "reducescatter": "lax.psum_scatter"}


#: The command that measures this machine and stores its entry (jax_blink/tools/tune.py).
TUNE_COMMAND = "jax-blink tune"
_PUBLIC_NAME = {"allreduce": "all_reduce", "broadcast": "broadcast", "reduce": "reduce",
                "allgather": "all_gather", "reducescatter": "reduce_scatter"}


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which measurement ``dispatch="auto"`` follows for one call: ``entry`` (its lax ranges
    decide) and ``source``: ``"tuned"`` (the user's cache, ``jax-blink tune``), ``"shipped"`` (the
    package's table) or ``"meanwhile"`` (no entry for this machine: :func:`dispatch_table.meanwhile`)."""

    entry: dispatch_table.Crossover
    source: str
    machine: _machine.MachineKey


def choice(collective: str, n: int, dtype: str | None, kind: str | None,
           ranks_layout: str = "one process") -> Choice:
    """The entry that ``dispatch="auto"`` follows for ``collective`` on ``n`` devices of ``kind``
    here: this machine's tuned entry (same links, jax and NCCL versions) if the cache holds one,
    else the shipped entry of this device model, count, links and layout, else the meanwhile rule."""
    key = _machine.this_machine(kind or "unknown", n, ranks_layout)
    return (_measured(key, collective, dtype)
            or Choice(dispatch_table.meanwhile(key.platform, collective, ranks_layout, dtype), "meanwhile", key))


def _measured(key: _machine.MachineKey, collective: str, dtype: str | None) -> Choice | None:
    """``key``'s tuned entry for ``collective`` if the cache holds one, else its shipped entry;
    None where it has neither."""
    tuned = dispatch_cache.lookup(key, collective, dtype)
    if tuned is not None:
        return Choice(tuned, "tuned", key)
    shipped = dispatch_table.entry(key.device_kind, key.ranks, collective, key.layout, dtype, key.links)
    return Choice(shipped, "shipped", key) if shipped is not None else None


def no_entry_message(key: _machine.MachineKey, dtype: str | None = None) -> str:
    """What a machine runs under ``dispatch="auto"`` for each collective that has no entry for it
    (tuned or shipped), and the command that measures one: the first call's warning and
    ``jax-blink env`` say it."""
    missing = [c for c in dispatch_table.COLLECTIVES if _measured(key, c, dtype) is None]
    parts = []
    for collective in missing:
        m = dispatch_table.meanwhile(key.platform, collective, key.layout, dtype)
        why = "" if m.sources else f" (never measured on a {key.platform} machine)"
        parts.append(f"{_PUBLIC_NAME[collective]}: {LAX_NAME[collective]} {dispatch_table.at_ranges(m.lax_ranges)}{why}")
    measured = [c for c in dispatch_table.COLLECTIVES if c not in missing]
    whom = ("this machine" if not measured else
            f"{', '.join(_PUBLIC_NAME[c] for c in missing)} on this machine (it has entries for "
            f"{', '.join(_PUBLIC_NAME[c] for c in measured)})")
    return (f"dispatch=\"auto\" has no measured entry for {whom} ({key.describe()}). Meanwhile it runs "
            f"jax_blink's executor only at sizes (bytes per rank) where the executor won on every "
            f"{key.platform} machine measured so far, and XLA's own collective elsewhere: "
            + "; ".join(parts)
            + f". Measure this machine with `{TUNE_COMMAND}` (a few minutes; it stores an entry in "
              f"{dispatch_cache.cache_file()} that dispatch=\"auto\" uses from then on), or set "
              "JAX_BLINK_DISPATCH=blink (always the executor) or lax")


def _warn_no_entry(key: _machine.MachineKey) -> None:
    if _no_entry_warned[0]:
        return
    _no_entry_warned[0] = True
    warnings.warn(f"jax_blink: {no_entry_message(key)} (said once per process)", RuntimeWarning, stacklevel=5)


def dispatch(collective: str, n: int, nbytes: int, dtype: str, kind: str | None,
             ranks_layout: str = "one process", warn: bool = True) -> Decision:
    """``config.dispatch`` for one call of ``collective`` with ``nbytes`` per rank on ``n`` devices of
    ``kind``: ``"auto"`` follows this machine's measured entry (:func:`choice`: tuned, shipped,
    or the meanwhile rule, which warns once per process unless ``warn`` is False: a report that
    prints the same text itself) for the operand's ``dtype`` and the ``ranks_layout``
    (``"one process"`` or ``"several processes"``)."""
    if config.dispatch == "lax":
        return Decision(False, "dispatch=lax (JAX_BLINK_DISPATCH or jax_blink.config.dispatch)")
    if config.dispatch == "blink":
        return Decision(True, "dispatch=blink: the executor runs every call")
    c = choice(collective, n, dtype, kind, ranks_layout)
    if c.source == "meanwhile" and warn:
        _warn_no_entry(c.machine)
    where = {"tuned": f"this machine's tuned entry, {dispatch_cache.cache_file()}",
             "shipped": "the shipped entry, jax_blink/lowering/dispatch_entries.json",
             "meanwhile": f"no entry for {c.machine.describe()}: the meanwhile rule, from every "
                          f"{c.machine.platform} machine measured; `{TUNE_COMMAND}` measures this one"}[c.source]
    if c.entry.prefers_lax(nbytes):
        return Decision(False, f"dispatch=auto: {LAX_NAME[collective]} at {nbytes} bytes per rank on {n} x {kind} "
                               f"({where})")
    return Decision(True, f"dispatch=auto: the executor at {nbytes} bytes per rank on {n} x {kind} ({where})")


def use_lax(collective: str, n: int, x, axes: tuple[str, ...] | None = None) -> bool:
    """Whether this explicit call of ``collective`` on operand ``x`` goes to XLA's own collective
    (:func:`dispatch` for the layout of the ranks over ``axes``)."""
    nbytes = x.size * np.dtype(x.dtype).itemsize
    return not dispatch(collective, n, nbytes, np.dtype(x.dtype).name, device_kind(), layout(axes, n)).executor


def layout(axes: tuple[str, ...] | None, n: int) -> str:
    """Where the ranks of a collective over ``axes`` live, as the dispatch table names it."""
    if axes is None or jax.process_count() == 1:
        return "one process"
    procs = _distributed.lowering_attrs(axes, n)["rank_process"]
    return "one process" if _distributed.one_process_per_group(procs, n) else "several processes"


@functools.lru_cache(maxsize=None)
def peer_access_problem(n: int) -> str | None:
    """Which pair of the first ``n`` GPUs lacks peer access (the CUDA executor needs every pair)."""
    mod = _backends.module("gpu")
    if mod is None or not hasattr(mod, "can_access_peer"):
        return None
    ids = [d.local_hardware_id for d in jax.devices("gpu")[:n]]
    for a in ids:
        for b in ids:
            if a != b and not mod.can_access_peer(a, b):
                return f"GPU {a} cannot access GPU {b}'s memory (no peer access)"
    return None


def hosts_of(axes: tuple[str, ...]):
    """The host layout of a collective whose ranks span hosts (jax_blink.lowering.hierarchy), else None."""
    if jax.process_count() == 1 or not _distributed.has_client():
        return None  # no client: executor_ready sends the call to lax and says why
    return _hierarchy.layout(axes)


def across_hosts_to_lax(what: str, axes: tuple[str, ...]) -> bool:
    """True (after the fall-back warning, or an error with fallback=raise) where a collective
    without a three-phase form has ranks on several hosts: they cannot meet in shared memory."""
    if jax.process_count() == 1 or hosts_of(axes) is None:
        return False
    fall_back(f"{what} has no three-phase form for ranks on several hosts "
               "(all_reduce, reduce_scatter and all_gather have)", what)
    return True


def three_phases(what: str, axes: tuple[str, ...]):
    """For a collective whose ranks span hosts: ``(layout, False)`` where its three phases
    (jax_blink.lowering.hierarchy) can run, ``(None, True)`` after the fall-back warning (or an error with
    fallback=raise) where they cannot, or without a word where every host holds one rank (all the
    traffic is between hosts, XLA's part: the executor has nothing to do); ``(None, False)`` where
    its ranks do not span hosts."""
    hosts = hosts_of(axes)
    if hosts is None:
        return None, False
    if hosts.local == 1:
        return None, True
    problem = _hierarchy.problem(hosts, current_platform())
    if problem is None:
        return hosts, False
    fall_back(f"{what} across hosts: {problem}", what)
    return None, True


def fall_back(problem: str, what: str) -> None:
    """``what`` goes to XLA's own collective because of ``problem``: raise, warn once per problem,
    or say nothing, as ``config.fallback`` says."""
    if config.fallback == "raise":
        raise RuntimeError(f"jax_blink: {problem}; {what} cannot run on jax_blink's executor "
                           "(JAX_BLINK_FALLBACK=raise; with warn or silent it goes to XLA's own collective)")
    msg = (f"jax_blink: {problem}; {what} falls back to XLA's own "
           "collective (set JAX_BLINK_FALLBACK=raise to make this an error)")
    if config.fallback == "warn" and problem not in _warned:
        _warned.add(problem)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def executor_problem(platform: str, what: str, n: int = 0, *, several_processes: bool = True) -> str | None:
    """Why the executor of ``platform`` cannot run ``what`` among ``n`` ranks here (None: it can).
    ``several_processes``: whether the caller can lower for ranks in several processes (explicit
    calls can, through shared memory or CUDA IPC; the switch cannot)."""
    if jax.process_count() > 1:
        if not several_processes:
            return (f"this job runs {jax.process_count()} processes and the switch lowers collectives "
                    "among the devices of one process")
        return _distributed.executor_problem(platform, what)
    if not _backends.register(platform):
        return f"no {platform} executor in this build"
    if platform == "gpu":
        return architecture_problem(n) or peer_access_problem(n)
    return None


@functools.lru_cache(maxsize=None)
def architecture_problem(n: int) -> str | None:
    """Which of the first ``n`` GPUs the CUDA executor's build cannot run on (no cubin or PTX for its
    architecture): the executor's own message, naming the GPU, its compute capability, what the
    build holds and the command that rebuilds it."""
    mod = _backends.module("gpu")
    if mod is None or not hasattr(mod, "device_problem"):
        return None
    for d in jax.devices("gpu")[:n]:
        problem = mod.device_problem(d.local_hardware_id)
        if problem:
            return problem
    return None


def executor_ready(platform: str, what: str, n: int = 0) -> bool:
    """Register the platform's executor; where it cannot run, fall back as ``config.fallback`` says."""
    problem = executor_problem(platform, what, n)
    if problem is None:
        return True
    fall_back(problem, what)
    return False
