"""The CPU executor of "jax_blink_collective", called directly with hand-written programs.

Runs on 8 XLA host devices (tests/conftest.py sets the flags; on the command line:
XLA_FLAGS=--xla_force_host_platform_device_count=8 PJRT_NPROC=16). Every program here is built by
hand in numpy (the layout of kernels/common/program.h) and every result is checked against a small numpy
interpreter of the same semantics (bitwise), against float64 math, and across ranks.
"""
from __future__ import annotations

import faulthandler
import functools
import itertools
import threading
import time

import numpy as np
import pytest

jax = pytest.importorskip("jax")
_blink_cpu = pytest.importorskip("jax_blink._blink_cpu")

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

N = 8
TARGET = "jax_blink_collective"
REDUCE, BROADCAST, BOTH = 1, 2, 3
OPS = {"sum": 0, "max": 1, "min": 2}
# Call-site ids far from the library's own (which count from 1).
_comm_ids = itertools.count(1 << 40)

if len(jax.devices("cpu")) < N:
    pytest.skip(f"needs {N} CPU host devices (XLA_FLAGS=--xla_force_host_platform_device_count={N})",
                allow_module_level=True)

_registered = False


def _register():
    global _registered
    if not _registered:  # registering twice is harmless in jax 0.10, but keep it once
        jax.ffi.register_ffi_target(TARGET, _blink_cpu.registrations()[TARGET], platform="cpu")
        _registered = True


_register()


@pytest.fixture(autouse=True)
def _hang_guard():
    """A test that hangs dumps every thread's stack and kills the process instead."""
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# ---------------------------------------------------------------------------------------------
# Programs, by hand.

def program(nranks, total, chunk, trees):
    """trees: (root, phases, offset, length, parent list)."""
    words = [1, nranks, len(trees), chunk, total]
    for root, phases, off, length, parent in trees:
        assert len(parent) == nranks and parent[root] == -1
        words += [root, phases, off, length, *parent]
    return np.asarray(words, np.int32)


def chain(n, root=0):
    """root - root+1 - ... wrapping around: parent of r is the previous rank."""
    return [-1 if r == root else (r - 1) % n for r in range(n)]


def star(n, root):
    return [-1 if r == root else root for r in range(n)]


def binary(n, root=0):
    order = [root] + [r for r in range(n) if r != root]  # heap layout over a relabelling
    parent = [-1] * n
    for i in range(1, n):
        parent[order[i]] = order[(i - 1) // 2]
    return parent


def split(total, parts):
    sizes = [total // parts + (1 if i < total % parts else 0) for i in range(parts)]
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    return list(zip(offs.tolist(), sizes))


def _children(parent, r):
    return [c for c, p in enumerate(parent) if p == r]


def _postorder(parent, root):
    out, stack = [], [(root, False)]
    while stack:
        v, done = stack.pop()
        if done:
            out.append(v)
        else:
            stack.append((v, True))
            stack.extend((c, False) for c in _children(parent, v))
    return out


def reference(prog, xs, op):
    """program.h's semantics in numpy: own value, then children in ascending rank order, 16-bit
    floats in float32 with one rounding per hop; out = in outside every segment."""
    nranks, ntrees, _, total = (int(v) for v in prog[1:5])
    stride = 4 + nranks
    fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
    flat = [np.asarray(x).reshape(-1) for x in xs]
    acc_t = np.float32 if flat[0].dtype.itemsize == 2 and flat[0].dtype.kind != "i" else flat[0].dtype
    outs = [x.copy() for x in flat]
    for t in range(ntrees):
        w = prog[5 + t * stride: 5 + (t + 1) * stride]
        root, phases, off, length = (int(v) for v in w[:4])
        parent = [int(v) for v in w[4:]]
        seg = slice(off, off + length)
        order = _postorder(parent, root)
        if phases & REDUCE:
            for r in order:
                acc = flat[r][seg].astype(acc_t)
                for c in _children(parent, r):
                    with np.errstate(over="ignore"):
                        acc = fn(acc, outs[c][seg].astype(acc_t))
                outs[r][seg] = acc.astype(flat[r].dtype)
        if phases & BROADCAST:
            for r in reversed(order):
                if parent[r] != -1:
                    outs[r][seg] = outs[parent[r]][seg]
    return [o.reshape(np.shape(x)) for o, x in zip(outs, xs)]


# ---------------------------------------------------------------------------------------------
# Running a program on the host devices.

@functools.cache
def _mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices("cpu")[: int(np.prod(shape))])


def collective(prog, *, op="sum", comm_id=None, timeout_ms=20000, mesh_shape=(N,),
               skip_rank=None, alias=False, calls=1, host_share=0.0):
    """A jitted f(x) with x of shape (devices, ...): every device calls the target on its row.

    The rank is the index along the last mesh axis, the group the index along the first one of a
    2-D mesh. ``skip_rank``: that rank does not call (lax.cond) when f's second argument is true.
    ``calls``: the target runs that many times in a fori_loop (output feeds the next input).
    """
    comm_id = next(_comm_ids) if comm_id is None else comm_id
    names = ("g", "x")[-len(mesh_shape):]
    mesh = _mesh(tuple(mesh_shape), names)
    spec = P(names if len(names) > 1 else names[0])

    def one(v, rank, group):
        call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(v.shape, v.dtype), has_side_effect=True,
                                input_output_aliases={0: 0} if alias else None)
        return call(v, rank, group, program=prog, op=np.int32(OPS[op]), comm_id=np.int64(comm_id),
                    timeout_ms=np.int64(timeout_ms), host_share=np.float32(host_share))

    def body(x, skip):
        rank = jax.lax.axis_index("x").astype(jnp.int32)
        group = jax.lax.axis_index("g").astype(jnp.int32) if len(names) > 1 else jnp.int32(0)
        step = lambda v: one(v, rank, group)
        if calls > 1:
            step = lambda v, s=step: jax.lax.fori_loop(0, calls, lambda i, u: s(u), v)
        if skip_rank is None:
            return step(x)
        return jax.lax.cond(jnp.logical_and(skip[0], rank == skip_rank), lambda v: v, step, x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=False),
                donate_argnums=(0,) if alias else ())
    sharding = NamedSharding(mesh, spec)

    def run(x, skip=False):
        x = np.asarray(x)
        with jax.enable_x64(x.dtype.itemsize == 8):  # float64 / int64 operands stay 64-bit
            xs = jax.device_put(x, sharding)
            return np.asarray(f(xs, jnp.asarray([skip])))

    run.comm_id = comm_id
    return run


def random_data(dtype, shape, rng, *, small_ints=True):
    dtype = np.dtype(dtype)
    if dtype.kind == "i":
        lim = 1000 if small_ints else np.iinfo(dtype).max
        return rng.integers(-lim, lim, size=shape, dtype=dtype)
    v = rng.standard_normal(shape).astype(np.float32) * 3 + 0.5
    return v.astype(dtype)


def bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def assert_bitwise(actual, expected):
    np.testing.assert_array_equal(bits(actual), bits(np.asarray(expected, actual.dtype)))


def exact(xs, op):
    x64 = np.asarray(xs).astype(np.float64)
    return {"sum": x64.sum(0), "max": x64.max(0), "min": x64.min(0)}[op]


def check_allreduce(out, xs, op):
    """Every rank bitwise identical, and close to the float64 result."""
    for r in range(1, len(out)):
        np.testing.assert_array_equal(bits(out[r]), bits(out[0]), err_msg=f"rank {r} differs from 0")
    dt = np.asarray(xs).dtype
    want = exact(xs, op)
    if dt.kind == "i" or op != "sum":
        np.testing.assert_array_equal(out[0].astype(np.float64), want.astype(dt).astype(np.float64))
    else:
        eps = float(ml_dtypes.finfo(dt).eps)
        scale = np.abs(np.asarray(xs).astype(np.float64)).sum(0)
        np.testing.assert_array_less(np.abs(out[0].astype(np.float64) - want), 2 * N * eps * scale + 1e-30)


# ---------------------------------------------------------------------------------------------
# Program shapes.

def _shapes(total, chunk):
    n = N
    halves = split(total, 2)
    eighths = split(total, n)
    thirds = split(total, 3)
    inner = (min(3, total), max(0, min(total - 2, total) - min(3, total)))  # leaves gaps both ends
    return {
        "chain": [(0, BOTH, 0, total, chain(n))],
        "chain_root7": [(7, BOTH, 0, total, [-1 if r == 7 else r + 1 for r in range(n)])],
        "star_root5": [(5, BOTH, 0, total, star(n, 5))],
        "binary": [(0, BOTH, 0, total, binary(n))],
        "two_trees": [(0, BOTH, *halves[0], chain(n, 0)), (6, BOTH, *halves[1], binary(n, 6))],
        "eight_stars": [(r, BOTH, *eighths[r], star(n, r)) for r in range(n)],
        "broadcast_only": [(5, BROADCAST, 0, total, binary(n, 5))],
        "reduce_only": [(2, REDUCE, 0, total, chain(n, 2))],
        "gaps": [(4, BOTH, *inner, binary(n, 4))],
        "mixed": [(1, BOTH, *thirds[0], chain(n, 1)), (3, BROADCAST, *thirds[2], star(n, 3)),
                  (6, REDUCE, *thirds[1], binary(n, 6)), (0, BOTH, 0, 0, star(n, 0))],
    }


SIZES = [(1, 1), (17, 4), (1000, 64), (4099, 1000)]
ALLREDUCE_SHAPES = {"chain", "chain_root7", "star_root5", "binary", "two_trees", "eight_stars"}


@pytest.mark.parametrize("total,chunk", SIZES, ids=[f"n{t}c{c}" for t, c in SIZES])
@pytest.mark.parametrize("shape", sorted(_shapes(17, 4)))
def test_program_shapes(shape, total, chunk):
    prog = program(N, total, chunk, _shapes(total, chunk)[shape])
    rng = np.random.default_rng(total * 31 + len(shape))
    xs = random_data(np.float32, (N, total), rng)
    out = collective(prog)(xs)
    ref = reference(prog, list(xs), "sum")
    for r in range(N):
        assert_bitwise(out[r], ref[r])
    if shape in ALLREDUCE_SHAPES:
        check_allreduce(out, xs, "sum")
    if shape == "broadcast_only":
        for r in range(N):
            assert_bitwise(out[r], xs[5])
    if shape == "reduce_only":
        np.testing.assert_allclose(out[2], xs.astype(np.float64).sum(0), rtol=1e-5, atol=1e-4)


DTYPES = [np.float32, np.float64, ml_dtypes.bfloat16, np.float16, np.int32, np.int64]


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_dtypes_and_ops(dtype, op):
    total, chunk = 37, 5
    trees = [(0, BOTH, 0, 20, binary(N, 0)), (7, BOTH, 20, 17, chain(N, 7))]
    prog = program(N, total, chunk, trees)
    rng = np.random.default_rng(hash((np.dtype(dtype).name, op)) % 2**32)
    xs = random_data(dtype, (N, total), rng)
    out = collective(prog, op=op)(xs)
    assert out.dtype == np.dtype(dtype)
    ref = reference(prog, list(xs), op)
    for r in range(N):
        assert_bitwise(out[r], ref[r])
    check_allreduce(out, xs, op)


def test_int32_sum_wraps_like_numpy():
    prog = program(N, 9, 4, [(3, BOTH, 0, 9, binary(N, 3))])
    xs = random_data(np.int32, (N, 9), np.random.default_rng(5), small_ints=False)
    out = collective(prog)(xs)
    want = xs.astype(np.int64).sum(0).astype(np.int32)  # two's complement wrap
    for r in range(N):
        np.testing.assert_array_equal(out[r], want)


def test_host_share_is_accepted_and_ignored():
    """The hybrid transfer's share (a GPU executor's host channel) changes nothing on host devices."""
    prog = program(N, 1000, 4, [(0, BOTH, 0, 1000, binary(N))])
    xs = random_data(np.float32, (N, 1000), np.random.default_rng(6))
    plain, shared = collective(prog)(xs), collective(prog, host_share=0.5)(xs)
    assert_bitwise(shared, plain)
    check_allreduce(shared, xs, "sum")


def test_multidimensional_operand_and_single_element():
    prog = program(N, 15, 4, [(0, BOTH, 0, 15, binary(N))])
    xs = random_data(np.float32, (N, 3, 5), np.random.default_rng(1))
    out = collective(prog)(xs.reshape(N * 3, 5).reshape(N, 3, 5))
    check_allreduce(out.reshape(N, -1), xs.reshape(N, -1), "sum")
    prog1 = program(N, 1, 1, [(6, BOTH, 0, 1, star(N, 6))])
    x1 = random_data(np.float16, (N,), np.random.default_rng(2))
    out1 = collective(prog1)(x1)
    check_allreduce(out1, x1, "sum")


def test_two_groups_on_a_2d_mesh():
    n = 4
    prog = program(n, 23, 3, [(0, BOTH, 0, 12, chain(n, 0)), (3, BOTH, 12, 11, star(n, 3))])
    xs = random_data(np.float32, (2 * n, 23), np.random.default_rng(3))
    f = collective(prog, mesh_shape=(2, n))
    out = f(xs)
    for g in range(2):
        rows = slice(g * n, (g + 1) * n)
        ref = reference(prog, list(xs[rows]), "sum")
        for r in range(n):
            assert_bitwise(out[g * n + r], ref[r])
        check_allreduce(out[rows], xs[rows], "sum")
    assert not np.array_equal(out[0], out[n])  # the groups did not mix
    st = _blink_cpu.comm_status(f.comm_id, 1)
    assert st is not None and st["nranks"] == n and st["calls"] == [1] * n


def test_many_calls_in_a_loop_and_many_launches():
    calls, launches = 1000, 5
    prog = program(N, 17, 4, [(2, BOTH, 0, 9, binary(N, 2)), (5, BOTH, 9, 8, chain(N, 5))])
    f = collective(prog, op="max", calls=calls)
    rng = np.random.default_rng(4)
    t0 = time.perf_counter()
    for _ in range(launches):
        xs = random_data(np.int32, (N, 17), rng)
        out = f(xs)
        check_allreduce(out, xs, "max")  # max is idempotent: 1000 rounds give one round's result
    elapsed = time.perf_counter() - t0
    st = _blink_cpu.comm_status(f.comm_id)
    assert st["calls"] == [calls * launches] * N
    assert st["open_calls"] == 0 and st["failures"] == 0 and st["in_flight"] == 0
    print(f"{calls * launches} calls of 8 ranks in {elapsed:.2f} s")


def test_loop_of_sums_matches_reference():
    prog = program(N, 33, 8, [(0, BOTH, 0, 16, chain(N)), (4, BOTH, 16, 17, binary(N, 4))])
    f = collective(prog, calls=20)
    xs = random_data(np.float64, (N, 33), np.random.default_rng(6)) / 8
    out = f(xs)
    want = list(xs)
    for _ in range(20):
        want = reference(prog, want, "sum")
    for r in range(N):
        assert_bitwise(out[r], want[r])


@pytest.mark.parametrize("shape", ["chain", "eight_stars", "broadcast_only", "reduce_only", "gaps"])
def test_in_place_with_donation(shape):
    total, chunk = 103, 8
    prog = program(N, total, chunk, _shapes(total, chunk)[shape])
    xs = random_data(np.float32, (N, total), np.random.default_rng(7))
    f = collective(prog, alias=True)
    out = f(xs)
    ref = reference(prog, list(xs), "sum")
    for r in range(N):
        assert_bitwise(out[r], ref[r])
    assert _blink_cpu.comm_status(f.comm_id)["in_place_calls"] == N  # XLA did alias in and out


def test_independent_calls_in_one_program():
    """Two call sites with no data dependence in one jitted program (XLA may order them freely)."""
    prog_a = program(N, 64, 8, [(0, BOTH, 0, 64, binary(N))])
    prog_b = program(N, 64, 16, [(r, BOTH, 8 * r, 8, star(N, r)) for r in range(N)])
    mesh = _mesh((N,), ("x",))
    ca, cb = next(_comm_ids), next(_comm_ids)

    def body(x, y):
        rank = jax.lax.axis_index("x").astype(jnp.int32)

        def call(v, prog, cid, op):
            return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(v.shape, v.dtype), has_side_effect=True)(
                v, rank, jnp.int32(0), program=prog, op=np.int32(op), comm_id=np.int64(cid),
                timeout_ms=np.int64(20000), host_share=np.float32(0))
        return call(x, prog_a, ca, 0), call(y, prog_b, cb, 1)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    rng = np.random.default_rng(8)
    for _ in range(20):
        xs, ys = random_data(np.float32, (N, 64), rng), random_data(np.float32, (N, 64), rng)
        sh = NamedSharding(mesh, P("x"))
        a, b = (np.asarray(v) for v in f(jax.device_put(xs, sh), jax.device_put(ys, sh)))
        check_allreduce(a, xs, "sum")
        check_allreduce(b, ys, "max")


def test_pmap():
    prog = program(N, 21, 4, [(3, BOTH, 0, 21, binary(N, 3))])
    cid = next(_comm_ids)

    def body(x):
        rank = jax.lax.axis_index("i").astype(jnp.int32)
        return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True)(
            x, rank, jnp.int32(0), program=prog, op=np.int32(0), comm_id=np.int64(cid),
            timeout_ms=np.int64(20000), host_share=np.float32(0))

    xs = random_data(np.float32, (N, 21), np.random.default_rng(9))
    out = np.asarray(jax.pmap(body, axis_name="i", devices=jax.devices("cpu")[:N])(xs))
    check_allreduce(out, xs, "sum")


# ---------------------------------------------------------------------------------------------
# Faults: never a hang, a clear error, and work again afterwards.

def _run_with_deadline(fn, seconds):
    """fn() in a thread; returns (result or exception, elapsed). Fails if it outlives `seconds`."""
    box = {}

    def target():
        t0 = time.perf_counter()
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["value"] = e
        box["elapsed"] = time.perf_counter() - t0

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"the call hung for more than {seconds} s"
    return box["value"], box["elapsed"]


TIMEOUT_MS = 1000


def test_rank_that_skips_times_out_then_the_collective_works_again():
    prog = program(N, 40, 8, [(0, BOTH, 0, 20, binary(N)), (5, BOTH, 20, 20, chain(N, 5))])
    f = collective(prog, timeout_ms=TIMEOUT_MS, skip_rank=3)
    xs = random_data(np.float32, (N, 40), np.random.default_rng(10))
    for attempt in range(2):  # a skipping rank fails every launch, each within the deadline
        err, elapsed = _run_with_deadline(lambda: f(xs, skip=True), 30)
        assert isinstance(err, Exception), f"expected an error, got {type(err)}"
        msg = str(err)
        assert "DEADLINE_EXCEEDED" in msg or "ABORTED" in msg, msg
        assert "did not join this collective" in msg, msg
        assert "Ranks that never joined this call: 3." in msg, msg
        assert f"collective {f.comm_id}" in msg, msg
        assert elapsed < TIMEOUT_MS / 1000 + 5, elapsed
    # The error reaches Python with the first shard that failed (device 0's); peers that time out
    # after it may still be leaving the handler (seen on jax 0.11.2, some ms): none may stay.
    st, deadline = _blink_cpu.comm_status(f.comm_id), time.perf_counter() + 5
    while st["in_flight"] and time.perf_counter() < deadline:
        time.sleep(0.01)
        st = _blink_cpu.comm_status(f.comm_id)
    assert st["failures"] == 2 and st["in_flight"] == 0
    assert st["calls"][3] == 0 and all(c == 2 for r, c in enumerate(st["calls"]) if r != 3)
    # The next launch where every rank takes part starts afresh.
    out, _ = _run_with_deadline(lambda: f(xs, skip=False), 30)
    assert isinstance(out, np.ndarray), out
    check_allreduce(out, xs, "sum")
    # An unrelated collective was never affected.
    g = collective(program(N, 5, 2, [(1, BOTH, 0, 5, star(N, 1))]))
    ys = random_data(np.float32, (N, 5), np.random.default_rng(11))
    check_allreduce(g(ys), ys, "sum")


def test_late_rank_fails_fast():
    """Rank 3 arrives 3 s late (a host callback sleeps first): the others time out after 1 s, and
    rank 3, arriving at a call that already failed, fails at once instead of waiting again."""
    prog = program(N, 12, 4, [(0, BOTH, 0, 12, binary(N))])
    mesh = _mesh((N,), ("x",))
    cid = next(_comm_ids)

    def nap(rank, v):
        if int(rank) == 3:
            time.sleep(3.0)
        return v

    def body(x):
        rank = jax.lax.axis_index("x").astype(jnp.int32)
        x = jax.pure_callback(nap, jax.ShapeDtypeStruct(x.shape, x.dtype), rank, x)
        return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True)(
            x, rank, jnp.int32(0), program=prog, op=np.int32(0), comm_id=np.int64(cid),
            timeout_ms=np.int64(TIMEOUT_MS), host_share=np.float32(0))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    xs = jax.device_put(random_data(np.float32, (N, 12), np.random.default_rng(17)),
                        NamedSharding(mesh, P("x")))
    out = f(xs)
    err, _ = _run_with_deadline(lambda: out.addressable_shards[3].data.block_until_ready(), 30)
    assert isinstance(err, Exception), err
    assert "already failed on its peers" in str(err) and "never joined this call: 3" in str(err), err
    st = _blink_cpu.comm_status(cid)
    assert st["open_calls"] == 0 and st["failures"] == 1  # every rank went through the failed call


def test_skip_inside_a_loop_fails_fast_on_late_calls():
    """Rank 3 skips every call of a 50-call loop: the first call times out, no launch hangs."""
    prog = program(N, 8, 8, [(0, BOTH, 0, 8, chain(N))])
    f = collective(prog, timeout_ms=TIMEOUT_MS, skip_rank=3, calls=50)
    xs = random_data(np.float32, (N, 8), np.random.default_rng(12))
    err, elapsed = _run_with_deadline(lambda: f(xs, skip=True), 60)
    assert isinstance(err, Exception) and "never joined" in str(err), err
    assert elapsed < TIMEOUT_MS / 1000 + 5, elapsed


def test_mismatched_programs_fail_fast():
    """Ranks 0-3 and 4-7 bring different programs under one comm_id: an error, not a hang."""
    prog_a = program(N, 16, 4, [(0, BOTH, 0, 16, chain(N))])
    prog_b = program(N, 16, 8, [(0, BOTH, 0, 16, chain(N))])
    mesh = _mesh((N,), ("x",))
    cid = next(_comm_ids)

    def body(x):
        rank = jax.lax.axis_index("x").astype(jnp.int32)

        def call(prog):
            return lambda v: jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(v.shape, v.dtype),
                                              has_side_effect=True)(
                v, rank, jnp.int32(0), program=prog, op=np.int32(0), comm_id=np.int64(cid),
                timeout_ms=np.int64(20000), host_share=np.float32(0))
        return jax.lax.cond(rank < 4, call(prog_a), call(prog_b), x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    xs = jax.device_put(random_data(np.float32, (N, 16), np.random.default_rng(13)),
                        NamedSharding(mesh, P("x")))
    err, elapsed = _run_with_deadline(lambda: np.asarray(f(xs)), 30)
    assert isinstance(err, Exception), err
    assert "differs from the one its peers run" in str(err), err
    assert elapsed < 5, elapsed  # well before the 20 s deadline


def test_program_for_fewer_ranks_than_the_axis():
    prog = program(4, 6, 2, [(0, BOTH, 0, 6, chain(4))])
    err, _ = _run_with_deadline(lambda: collective(prog, timeout_ms=TIMEOUT_MS)(
        random_data(np.float32, (N, 6), np.random.default_rng(14))), 30)
    assert isinstance(err, Exception) and "outside the program's 4 ranks" in str(err), err


@pytest.mark.parametrize("bad,words", [
    ("cycle", lambda: program(N, 4, 2, [(0, BOTH, 0, 4, [-1, 2, 1, 0, 0, 0, 0, 0])])),
    ("overlap", lambda: program(N, 4, 2, [(0, BOTH, 0, 3, chain(N)), (1, BOTH, 2, 2, chain(N, 1))])),
    ("phases", lambda: program(N, 4, 2, [(0, 0, 0, 4, chain(N))])),
    ("outside", lambda: program(N, 4, 2, [(0, BOTH, 2, 3, chain(N))])),
    ("version", lambda: np.concatenate([[7], program(N, 4, 2, [(0, BOTH, 0, 4, chain(N))])[1:]]).astype(np.int32)),
])
def test_bad_programs_are_rejected(bad, words):
    expect = {"cycle": "cycle", "overlap": "overlap", "phases": "phases", "outside": "segment outside",
              "version": "program version 7"}[bad]
    err, elapsed = _run_with_deadline(lambda: collective(words(), timeout_ms=TIMEOUT_MS)(
        random_data(np.float32, (N, 4), np.random.default_rng(15))), 30)
    assert isinstance(err, Exception) and expect in str(err) and "INVALID_ARGUMENT" in str(err), err
    assert elapsed < 5


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.complex64])
def test_unsupported_dtype(dtype):
    prog = program(N, 4, 2, [(0, BOTH, 0, 4, chain(N))])
    xs = (np.arange(N * 4) % 7).astype(dtype).reshape(N, 4)
    err, _ = _run_with_deadline(lambda: collective(prog, timeout_ms=TIMEOUT_MS)(xs), 30)
    assert isinstance(err, Exception), err
    assert np.dtype(dtype).name in str(err) and "supported: float32" in str(err), err


def test_module_surface():
    assert TARGET in _blink_cpu.registrations()
    assert "CPU executor" in _blink_cpu.version()
    assert _blink_cpu.num_comms() >= 1
    assert _blink_cpu.comm_status(-12345) is None


def test_reset_drops_state_and_calls_work_after():
    prog = program(N, 10, 4, [(0, BOTH, 0, 10, binary(N))])
    f = collective(prog)
    xs = random_data(np.float32, (N, 10), np.random.default_rng(16))
    check_allreduce(f(xs), xs, "sum")
    _blink_cpu.reset()
    assert _blink_cpu.num_comms() == 0 and _blink_cpu.comm_status(f.comm_id) is None
    check_allreduce(f(xs), xs, "sum")
    assert _blink_cpu.comm_status(f.comm_id)["calls"] == [1] * N


@pytest.fixture(scope="module", autouse=True)
def _end_on_a_good_launch():
    """JAX keeps the runtime token of the last side-effecting launch; if that launch failed, it
    re-raises the error at interpreter exit. End the module on a good launch."""
    yield
    prog = program(N, 3, 1, [(0, BOTH, 0, 3, chain(N))])
    collective(prog)(random_data(np.float32, (N, 3), np.random.default_rng(0)))
