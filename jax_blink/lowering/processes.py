"""Jobs of several processes (``jax.distributed``): the job's key, and where each rank lives.

* :func:`setup` gives the CPU executor this job's key (process 0 draws it, the job's key-value
  store carries it to the others, as XLA shares NCCL ids) so that the shared-memory segments of one
  job are named by it and a segment of another job, or of a crashed one, is never opened.
* :func:`rank_layout` says which process and device every rank of a collective has: from the
  concrete mesh in context (``jax.set_mesh`` / ``jax.sharding.use_mesh``) where there is one, else
  the job's devices in ``jax.devices()`` order laid out as the abstract mesh (how ``jax.make_mesh``
  lays out CPU host devices).
* :func:`host_of_process` groups processes into hosts (the three-phase collectives of
  :mod:`jax_blink.lowering.hierarchy`): by host name, exchanged through the store, unless
  ``JAX_BLINK_PROCESSES_PER_HOST`` or :func:`set_processes_per_host` says how many consecutive
  processes share a host (tests make "hosts" of groups of processes on one machine).
"""
from __future__ import annotations

import atexit
import collections
import functools
import math
import secrets
import socket
import struct
import threading
import time
import weakref

import jax
import numpy as np

from jax_blink.lowering import backends as _backends
from jax_blink.options.settings import env_value

_KEY = "jax_blink/job_key"
_HOST_KEY = "jax_blink/host/{}"

#: A communicator's set-up budget unless JAX_BLINK_SETUP_TIMEOUT_S says otherwise.
DEFAULT_SETUP_TIMEOUT_S = 60.0

_processes_per_host: int | None = None


def _client():
    from jax._src import distributed  # the client XLA itself uses for NCCL ids

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            f"jax_blink: this job runs {jax.process_count()} processes but has no jax.distributed "
            "client: call jax.distributed.initialize(...) in every process before the first collective")
    return client


def has_client() -> bool:
    """Whether this process has a jax.distributed client (its key-value store)."""
    from jax._src import distributed

    return distributed.global_state.client is not None


@functools.cache
def job_key() -> str:
    """This job's key: 16 hex digits drawn by process 0 and shared through the key-value store."""
    client = _client()
    if jax.process_index() == 0:
        key = secrets.token_hex(8)
        client.key_value_set(_KEY, key)
        return key
    wait_s = setup_timeout_s()  # part of the first collective's set-up: its budget
    try:
        return str(client.blocking_key_value_get(_KEY, int(wait_s * 1000)))
    except Exception as e:  # the store's own error says little: name the process
        raise RuntimeError(
            f"jax_blink: process {jax.process_index()} waited {wait_s:g} s (JAX_BLINK_SETUP_TIMEOUT_S) for process 0 "
            f"to publish the job key ({type(e).__name__}: {e}); process 0 did not answer (it died, "
            "or it does not run the same collectives as this process)") from e


def cleanup() -> list[str]:
    """Unlink this process's shared-memory segments whose set-up never completed and unmap idle
    ones (run at exit). Returns the names it unlinked."""
    mod = _backends.module("cpu")
    return list(mod.shm_cleanup()) if mod is not None and hasattr(mod, "shm_cleanup") else []


@functools.cache
def setup() -> None:
    """Give the CPU executor this job's key and process index (once per process)."""
    mod = _backends.module("cpu")
    if mod is None or not hasattr(mod, "shm_set_job"):
        raise RuntimeError("jax_blink: this build's CPU executor has no shared-memory path (rebuild jax_blink)")
    mod.shm_set_job(job_key(), jax.process_index())
    atexit.register(cleanup)


def _concrete_mesh():
    try:
        from jax._src import mesh as mesh_lib

        m = mesh_lib.get_concrete_mesh()
    except Exception:  # not in every jax version
        return None
    return None if m is None or getattr(m, "empty", True) else m


def mesh_devices() -> tuple[np.ndarray, tuple[str, ...], tuple[str, ...]] | None:
    """The devices of the mesh being traced, shaped as the mesh, its axis names and its manual
    axes; None outside a mesh (pmap) or where the devices cannot be known."""
    try:
        abstract = jax.sharding.get_abstract_mesh()
        names, sizes = tuple(abstract.axis_names), tuple(abstract.axis_sizes)
    except Exception:
        return None
    if not names:
        return None
    manual = tuple(getattr(abstract, "manual_axes", names))
    m = _concrete_mesh()
    if m is not None and tuple(m.axis_names) == names and m.devices.shape == sizes:
        return m.devices, names, manual
    platform = getattr(getattr(abstract, "abstract_device", None), "platform", None)
    devices = jax.devices(platform) if platform else jax.devices()
    if len(devices) != math.prod(sizes):
        return None
    return np.array(devices, dtype=object).reshape(sizes), names, manual


def rank_devices(axes: tuple[str, ...]) -> np.ndarray | None:
    """The device of every (group, rank) of a collective over ``axes``, shape (groups, ranks):
    ranks numbered row-major over ``axes`` (as ``lax.axis_index``), groups row-major over the
    other manual axes of size > 1 in mesh order (as the lowering numbers them)."""
    found = mesh_devices()
    if found is None:
        return None
    devices, names, manual = found
    if not all(a in names for a in axes):
        return None
    others = [i for i, a in enumerate(names) if a not in axes and a in manual and devices.shape[i] > 1]
    rest = [i for i in range(len(names)) if i not in others and names[i] not in axes]
    order = others + [names.index(a) for a in axes] + rest
    t = np.transpose(devices, order)
    groups = math.prod(devices.shape[i] for i in others)
    n = math.prod(devices.shape[names.index(a)] for a in axes)
    return t.reshape(groups, n, -1)[:, :, 0]


def rank_layout(axes: tuple[str, ...], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(process index, device id) of every rank of every group, flat ``[group * n + rank]``, as the
    executor reads them for its messages; ``-1`` each where unknown."""
    devs = rank_devices(axes)
    if devs is None or devs.shape[1] != n:
        return np.full(n, -1, np.int32), np.full(n, -1, np.int32)
    procs = np.array([d.process_index for d in devs.flat], np.int32)
    ids = np.array([d.id for d in devs.flat], np.int32)
    return procs, ids


def set_processes_per_host(k: int | None) -> None:
    """Treat every ``k`` consecutive processes as one host (None: group by host name)."""
    global _processes_per_host
    if k is not None and (not isinstance(k, int) or k < 1):
        raise ValueError(f"processes per host must be a positive int or None, got {k!r}")
    _processes_per_host = k


def processes_per_host() -> int | None:
    """:func:`set_processes_per_host`'s value, else ``JAX_BLINK_PROCESSES_PER_HOST``, else None."""
    if _processes_per_host is not None:
        return _processes_per_host
    return env_value("JAX_BLINK_PROCESSES_PER_HOST", _positive_int, "a positive integer")


@functools.cache
def _publish_host_name() -> None:
    # Once per process: the store refuses a key set twice, and a gather that failed (a process
    # late) is tried again at the next collective.
    _client().key_value_set(_HOST_KEY.format(jax.process_index()), socket.gethostname())


@functools.cache
def _host_names() -> tuple[str, ...]:
    if jax.process_count() == 1:
        return (socket.gethostname(),)
    client = _client()
    _publish_host_name()
    names = []
    deadline = time.monotonic() + setup_timeout_s()  # part of the first collective's set-up: its budget
    for p in range(jax.process_count()):
        try:
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            names.append(str(client.blocking_key_value_get(_HOST_KEY.format(p), left_ms)))
        except Exception as e:
            raise RuntimeError(f"jax_blink: process {jax.process_index()} waited {setup_timeout_s():g} s "
                               f"(JAX_BLINK_SETUP_TIMEOUT_S) for process {p} to publish its host name; process {p} "
                               "did not answer (it died, or it has not reached this collective)") from e
    return tuple(names)


def host_of_process(process_index: int) -> int:
    """The host of a process: hosts numbered in order of their first process."""
    k = processes_per_host()
    if k is not None:
        return process_index // k
    names = _host_names()
    return list(dict.fromkeys(names)).index(names[process_index])


# ---------------------------------------------------------------------------------------------
# Hooks of the lowering (jax_blink.api.collectives).

def executor_problem(platform: str, what: str = "all_reduce") -> str | None:
    """Why ``what`` in this multi-process job cannot run on ``platform``'s executor (None: it
    can; the job is set up)."""
    if platform == "gpu":
        return _gpu_problem(what)
    if platform != "cpu":
        return f"this job runs {jax.process_count()} processes and jax_blink has no {platform} executor"
    if not _backends.register("cpu") or not hasattr(_backends.module("cpu"), "shm_set_job"):
        return "no cpu executor with a shared-memory path in this build"
    from jax._src import distributed

    if distributed.global_state.client is None:
        return (f"this job runs {jax.process_count()} processes but has no jax.distributed client to "
                "share the job's key through (call jax.distributed.initialize in every process)")
    setup()
    return None


def setup_timeout_s() -> float:
    """The budget of a communicator's set-up (its first call), in which every process must reach
    it: ``JAX_BLINK_SETUP_TIMEOUT_S``, default :data:`DEFAULT_SETUP_TIMEOUT_S` (processes compile
    and start at different times, so this is longer than a call's budget)."""
    return env_value("JAX_BLINK_SETUP_TIMEOUT_S", _setup_seconds, "a number of seconds in (0, 3600]",
                     DEFAULT_SETUP_TIMEOUT_S)


def _positive_int(text: str) -> int:
    k = int(text)
    if k < 1:
        raise ValueError("not a positive integer")
    return k


def _setup_seconds(text: str) -> float:
    v = float(text)
    if not 0 < v <= 3600:  # (also NaN)
        raise ValueError("not in (0, 3600]")
    return v


def one_process_per_group(rank_process: np.ndarray, n: int) -> bool:
    """Whether every group's n ranks are known to live in one process: then the in-process
    executor runs the call (no shared memory)."""
    if rank_process.size % n or (rank_process < 0).any():
        return False
    return bool((rank_process.reshape(-1, n) == rank_process.reshape(-1, n)[:, :1]).all())


def lowering_attrs(axes: tuple[str, ...], n: int, tables=None) -> dict:
    """The shared-memory executor's extra attributes: every rank's process and device (``tables``,
    else from the mesh), and the set-up budget."""
    procs, ids = tables if tables is not None else rank_layout(axes, n)
    return {"rank_process": procs, "rank_device": ids,
            "setup_timeout_ms": np.int64(round(setup_timeout_s() * 1000))}


# ---------------------------------------------------------------------------------------------
# One order of collectives in every process.

_last = threading.local()


@jax.custom_jvp
def after(x, dep):
    """``x``, computed only once ``dep`` exists (the CPU executor's ``jax_blink_after`` call): an
    operand of a custom call, which XLA keeps, unlike an ``optimization_barrier``."""
    call = jax.ffi.ffi_call(_backends.TARGET_AFTER, jax.ShapeDtypeStruct(x.shape, x.dtype),
                            input_output_aliases={0: 0}, vmap_method="broadcast_all")
    return call(x, dep)


@after.defjvp
def _after_jvp(primals, tangents):
    x, dep = primals
    return after(x, dep), tangents[0]


def in_program_order(run):
    """Decorates the collectives' common runner: on CPU, each collective's operand waits for the
    previous collective's result in the same trace (an operand of a custom call, which XLA cannot
    optimise away, unlike an optimization barrier), so every device and every process runs a
    program's collectives in the order they were written. XLA's CPU runtime otherwise runs
    independent calls in an order of its own on each device (and in each process), and ranks
    blocked in different calls (or in XLA's own collectives between the phases of a three-phase
    all-reduce) wait for each other until the time budget ends. Seen in one process too: the
    per-leaf gradient all-reduces of a value_and_grad step (tests/unit/test_ordering.py)."""

    @functools.wraps(run)
    def wrapper(what, x, *args, **kwargs):
        from jax._src import core

        trace = core.trace_ctx.trace
        prev = getattr(_last, "value", None)
        if (prev is not None and _last.trace() is trace and x.size
                and _backends.register("cpu") and _platform_of(x) == "cpu"):
            x = after(x, prev.reshape(-1)[:1])
        out = run(what, x, *args, **kwargs)
        _last.trace, _last.value = weakref.ref(trace), out
        return out

    return wrapper


def _platform_of(x) -> str:
    try:
        return jax.sharding.get_abstract_mesh().abstract_device.platform
    except Exception:
        return jax.default_backend()


# ---------------------------------------------------------------------------------------------
# GPUs: CUDA IPC (kernels/cuda/ipc.h), set up at trace time through the store.

_IPC_KEY = "jax_blink/ipc/{}/{}/{}"  # comm_id, group, rank
#: The collectives of the CUDA IPC executor, numbered as kernels/cuda/ipc.h's Collective.
IPC_COLLECTIVES = {"allreduce": 0, "allgather": 1, "reducescatter": 2, "broadcast": 3, "reduce": 4}
_PROBE_COMM = -1  # the job's probe region: can these processes open each other's memory?
# What every rank of a call site states beside its CUDA IPC handle: operand bytes per rank, the
# collective, its root, the rank count. Peers that differ would write past each other's regions
# or wait for each other for ever (a process whose operand has another shape: issue 31), so the
# set-up compares them first and fails every process with an error naming both.
_IPC_HEADER = struct.Struct("<qiii")


def ipc_record(nbytes: int, collective: str, root: int | None, n: int, payload: bytes) -> bytes:
    """The store's record of one rank's set-up: :data:`_IPC_HEADER` then the CUDA IPC payload."""
    return _IPC_HEADER.pack(int(nbytes), IPC_COLLECTIVES[collective], int(root or 0), int(n)) + bytes(payload)


def ipc_unpack(record: bytes, nbytes: int, collective: str, root: int | None, n: int, *, comm_id: int,
               rank: int, peer: int, peer_process: int) -> bytes:
    """The CUDA IPC payload of a peer's ``record``; RuntimeError where the peer set up this call
    site with another operand size, collective, root or rank count than this rank did."""
    if len(record) < _IPC_HEADER.size:
        raise RuntimeError(f"jax_blink (CUDA IPC, collective {comm_id}): rank {peer} (process {peer_process}) "
                           "published a set-up record of another format: every process must run the same "
                           "jax_blink version")
    theirs = _IPC_HEADER.unpack_from(record)
    mine = (int(nbytes), IPC_COLLECTIVES[collective], int(root or 0), int(n))
    if theirs != mine:
        names = {v: k for k, v in IPC_COLLECTIVES.items()}

        def say(h):
            return f"{h[0]} bytes per rank, {names.get(h[1], h[1])} (root {h[2]}) among {h[3]} ranks"
        raise RuntimeError(
            f"jax_blink (CUDA IPC, collective {comm_id}): rank {peer} (process {peer_process}) calls this "
            f"collective with {say(theirs)}, rank {rank} of this process with {say(mine)}. Every rank must "
            "pass an operand of the same shape and dtype to the same collective: make every process trace "
            "the same program (same shapes, same call order)")
    return record[_IPC_HEADER.size:]


def _gpu_problem(what: str) -> str | None:
    mod = _backends.module("gpu")
    if mod is None or not hasattr(mod, "ipc_create") or not _backends.register("gpu"):
        return "no CUDA executor with a CUDA IPC path in this build"
    if not has_client():
        return (f"this job runs {jax.process_count()} processes but has no jax.distributed client to "
                "exchange CUDA IPC handles through (call jax.distributed.initialize in every process)")
    return _ipc_probe()


@functools.cache
def _ipc_probe() -> str | None:
    """Whether this process can open the GPU memory of the job's other processes on its host (one
    small region each, exchanged through the store once); CUDA's reason where it refuses.
    Processes on other hosts are never opened: ranks there meet through XLA's collectives."""
    mod = _backends.module("gpu")
    client = _client()
    n, me = jax.process_count(), jax.process_index()
    hosts = [host_of_process(p) for p in range(n)]
    peers = [p for p in range(n) if p != me and hosts[p] == hosts[me]]
    try:
        payload = mod.ipc_create(_PROBE_COMM, 0, me, n, 256, int(jax.local_devices()[0].local_hardware_id))
        client.key_value_set_bytes(_IPC_KEY.format(_PROBE_COMM, 0, me), payload)
        for p in peers:
            try:
                theirs = client.blocking_key_value_get_bytes(_IPC_KEY.format(_PROBE_COMM, 0, p),
                                                             int(setup_timeout_s() * 1000))
            except Exception as e:
                raise RuntimeError(f"process {p} did not publish its CUDA IPC handle within "
                                   f"{setup_timeout_s():g} s ({type(e).__name__})") from e
            mod.ipc_open(_PROBE_COMM, 0, me, p, theirs)
    except RuntimeError as e:
        return f"CUDA IPC between this job's processes failed: {e}"
    return None


#: The last CUDA IPC set-ups of this process, oldest first (:func:`ipc_setup_log`).
_SETUP_LOG: collections.deque = collections.deque(maxlen=64)


def ipc_setup_log() -> list[dict]:
    """This process's last CUDA IPC set-ups (at most 64), oldest first: each call site's
    ``comm_id``, rank count, collective, bytes per rank, ``outcome`` ("ok", "running" or the
    error), ``started`` (wall clock, s) and ``seconds``, so that a job whose processes disagree on
    a call site, or reach it at different times, can be read afterwards."""
    return [dict(e) for e in _SETUP_LOG]


def ipc_setup(comm_id: int, n: int, nbytes: int, rank_process: np.ndarray, rank_device: np.ndarray,
              collective: str = "allreduce", root: int | None = None) -> None:
    """Register this process's ranks of call site ``comm_id`` (every group) for CUDA IPC, publish
    their handles in the store and open their peers' (once per call site, at trace time).
    ``collective``: a key of :data:`IPC_COLLECTIVES` (``root`` for broadcast and reduce). Raises
    RuntimeError naming the process that did not answer or why CUDA refused."""
    if collective not in IPC_COLLECTIVES:
        raise ValueError(f"jax_blink: {collective!r} has no CUDA IPC form; it takes one of {sorted(IPC_COLLECTIVES)}")
    entry = {"comm_id": int(comm_id), "n": int(n), "collective": collective, "bytes": int(nbytes),
             "outcome": "running", "started": time.time()}
    _SETUP_LOG.append(entry)
    try:
        _ipc_setup(comm_id, n, nbytes, rank_process, rank_device, collective, root)
    except BaseException as e:
        entry["outcome"] = f"{type(e).__name__}: {e}"[:300]
        raise
    finally:
        entry["seconds"] = round(time.time() - entry["started"], 3)
    entry["outcome"] = "ok"


def _ipc_setup(comm_id, n, nbytes, rank_process, rank_device, collective, root) -> None:
    mod = _backends.module("gpu")
    client = _client()
    me = jax.process_index()
    if (rank_process < 0).any():
        raise RuntimeError("the devices of this collective's ranks are unknown at lowering time: use a "
                           "mesh of the job's devices (jax.make_mesh / jax.set_mesh)")
    local = {d.id: d for d in jax.local_devices()}
    mine = [(i // n, i % n) for i in range(rank_process.size) if rank_process[i] == me]
    for g, r in mine:
        dev = local.get(int(rank_device[g * n + r])) if comm_id != _PROBE_COMM else jax.local_devices()[0]
        if dev is None:
            raise RuntimeError(f"rank {r} of group {g} is on device {rank_device[g * n + r]}, not one of this process's")
        payload = mod.ipc_create(comm_id, g, r, n, int(nbytes), int(dev.local_hardware_id),
                                 IPC_COLLECTIVES[collective], int(root or 0),
                                 [int(p) for p in rank_process[g * n:(g + 1) * n]])
        client.key_value_set_bytes(_IPC_KEY.format(comm_id, g, r), ipc_record(nbytes, collective, root, n, payload))
    for g, r in mine:
        for q in range(n):
            if q == r:
                continue
            try:
                payload = client.blocking_key_value_get_bytes(_IPC_KEY.format(comm_id, g, q),
                                                              int(setup_timeout_s() * 1000))
            except Exception as e:  # the store's error says little: name the process
                raise RuntimeError(f"process {me} waited {setup_timeout_s():g} s for the CUDA IPC handle of "
                                   f"rank {q} (process {int(rank_process[g * n + q])}), which did not answer "
                                   f"({type(e).__name__})") from e
            payload = ipc_unpack(payload, nbytes, collective, root, n, comm_id=comm_id, rank=r, peer=q,
                                 peer_process=int(rank_process[g * n + q]))
            mod.ipc_open(comm_id, g, r, q, payload)
