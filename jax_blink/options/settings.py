"""Run-time options of jax_blink, read from the environment once and changeable in code.

``JAX_BLINK_TIMEOUT_S``   budget of every wait inside a collective (default 10 s)
``JAX_BLINK_CHUNK_BYTES`` pipelining chunk in bytes (65536, 512K, 16M; default: the schedule's); ``auto``: the chunk
                          that ``jax_blink.tools.autotune.tune_chunk`` measured best for this device
                          kind, rank count, collective, dtype and size class, where it has one
``JAX_BLINK_COMMAND_BUFFERS`` ``auto`` (default): the handler that XLA may capture in CUDA graphs for
                          one-hop all-reduces (<= 512 KiB per rank, one process), the plain one for the
                          rest; ``1``: that handler for every GPU call; ``0``: never (the first call of
                          each call site must run uncaptured: XLA's first run of a program does)
``JAX_BLINK_DISPATCH``    ``auto`` (default): ``all_reduce`` uses ``lax.psum`` where that was measured
                          faster (jax_blink/lowering/dispatch_table.py); ``blink``: always the executor; ``lax``: never
``JAX_BLINK_FALLBACK``    ``warn`` (default): use ``lax`` collectives with one warning where no
                          executor can run (no peer access, no CUDA build, several processes);
                          ``raise``: refuse;
                          ``silent``: fall back without a word.
``JAX_BLINK_MERGE_BYTES`` the switch merges adjacent all-reduces of one dtype into calls of at most
                          this many bytes per rank (default 25M, as DDP's buckets); ``0``: no merging
``JAX_BLINK_ALLREDUCE_FORM`` ``auto`` (default): the planner runs each all-reduce in the form the
                          model finds fastest for its topology and size (jax_blink/planning/forms.py);
                          ``reduce_broadcast`` (Blink's trees), ``rings``, ``scatter_gather``,
                          ``shallow_trees`` or ``one_hop``: that form (a call on which it cannot run
                          is refused at trace time, naming the forms that can)

``config.NAME = value`` checks the value at once (TypeError/ValueError naming the option, the value
and what it takes) and refuses names that are not options (AttributeError listing them). A
``JAX_BLINK_*`` variable that nothing reads (a misspelling) gets one warning that lists the known
ones (:data:`KNOWN_ENVIRONMENT`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import numbers
import operator
import os
import sys
import warnings

import numpy as np

_FALLBACKS = ("warn", "raise", "silent")
MAX_TIMEOUT_S = 1e6  # the budget travels in milliseconds as an int64 attribute; 11 days is plenty
_DISPATCH = ("auto", "blink", "lax")
#: ``allreduce_form`` values: the planner's choice, or one form of jax_blink/planning/forms.py
#: (which takes its FORMS from here: options sit below planning).
ALLREDUCE_FORMS = ("auto", "reduce_broadcast", "rings", "scatter_gather", "shallow_trees", "one_hop")
#: ``chunk_bytes`` value that means: the tuned chunk from the cache (:mod:`jax_blink.lowering.chunk_cache`).
AUTO = "auto"
#: DDP's ``bucket_cap_mb=25``: the default bucket of :func:`jax_blink.api.buckets.bucketed`, and
#: of ``merge_bytes``.
DEFAULT_BUCKET_BYTES = 25 << 20
#: DDP's ``dist._DEFAULT_FIRST_BUCKET_BYTES``.
DEFAULT_FIRST_BUCKET_BYTES = 1 << 20
_MIN_CHUNK_BYTES = 16  # the schedule aligns chunks to 16 bytes


def _got(value) -> str:
    return f"got {value!r} ({type(value).__name__})"


def _check_timeout_s(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"timeout_s must be a number of seconds (int or float), {_got(value)}")
    v = float(value)
    if not 0 < v <= MAX_TIMEOUT_S:  # also refuses nan and inf
        raise ValueError(f"timeout_s must be > 0 and at most {MAX_TIMEOUT_S:g} seconds, got {value!r}")
    return v


def _check_chunk_bytes(value) -> int | str | None:
    if value is None:
        return value
    if isinstance(value, str):
        if value == AUTO:
            return value
        raise ValueError(f"chunk_bytes must be a whole number of bytes >= {_MIN_CHUNK_BYTES}, {AUTO!r} "
                         f"or None, {_got(value)} (a string other than {AUTO!r})")
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"chunk_bytes must be a whole number of bytes >= {_MIN_CHUNK_BYTES}, {AUTO!r} "
                        f"or None, {_got(value)}") from None
    if not _MIN_CHUNK_BYTES <= v < 1 << 63:
        raise ValueError(f"chunk_bytes must be >= {_MIN_CHUNK_BYTES} bytes (or {AUTO!r} or None), "
                         f"got {value!r}")
    return int(v)


#: How a bucket's leaves become the executor's flat operand and come back (``bucket_packing``).
BUCKET_PACKINGS = ("barrier", "xla", "kernel")
#: What the switch's starts hold (``switch_hold``).
SWITCH_HOLDS = ("recent", "weights", "none")


def _choice(field: str, choices: tuple[str, ...]):
    def check(value) -> str:
        if not isinstance(value, str):
            raise TypeError(f"{field} must be one of {choices}, {_got(value)}")
        if value not in choices:
            raise ValueError(f"{field} must be one of {choices}, got {value!r}")
        return value
    return check


def _check_command_buffers(value) -> bool | str:
    if isinstance(value, str) and value == AUTO:
        return AUTO
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"command_buffers must be True, False or {AUTO!r}, {_got(value)}")
    return bool(value)


def _flag(name: str):
    def check(value) -> bool:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, {_got(value)}")
        return bool(value)
    return check


def _check_merge_bytes(value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"merge_bytes must be a whole number of bytes, {_got(value)}")
    if value < 0:
        raise ValueError(f"merge_bytes must be >= 0 (0 turns merging off), {_got(value)}")
    return int(value)


def check_piece_count(name: str, value) -> int:
    """``value`` as a count of calls that a bucket is cut into (``name`` says whose, in the message).

    Raises:
        TypeError: ``value`` is not a whole number (a bool is not).
        ValueError: ``value`` is below 1.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a whole number >= 1, {_got(value)}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1 (1: the bucket whole), {_got(value)}")
    return int(value)


# Every option, with the check that a value must pass to be set. A check returns the value to store
# (plain Python types) or raises TypeError (wrong kind of value) / ValueError (out of range), naming
# the option, the value and what it takes.
_CHECKS = {
    "timeout_s": _check_timeout_s,
    "chunk_bytes": _check_chunk_bytes,
    "merge_bytes": _check_merge_bytes,
    "fallback": _choice("fallback", _FALLBACKS),
    "command_buffers": _check_command_buffers,
    "dispatch": _choice("dispatch", _DISPATCH),
    "allreduce_form": _choice("allreduce_form", ALLREDUCE_FORMS),
    "switch_overlap": _flag("switch_overlap"),
    "switch_late_last_wait": _flag("switch_late_last_wait"),
    "switch_sparse_gradients": _flag("switch_sparse_gradients"),
    "switch_last_bucket_pieces": lambda value: check_piece_count("switch_last_bucket_pieces", value),
    "bucket_packing": _choice("bucket_packing", BUCKET_PACKINGS),
    "switch_hold": _choice("switch_hold", SWITCH_HOLDS),
}


def check_chunk_bytes(value) -> None:
    """Raise ValueError/TypeError unless ``value`` is None, ``"auto"`` or a whole number of bytes >= 16."""
    _check_chunk_bytes(value)


def _no_such_option(name: str) -> AttributeError:
    near = difflib.get_close_matches(name, _CHECKS, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return AttributeError(f"jax_blink.config has no option {name!r}{hint}; "
                          f"the options are: {', '.join(_CHECKS)}")


@dataclasses.dataclass
class Options:
    """jax_blink's options; ``jax_blink.config`` is the one in force.

    Every assignment is checked: a value an option does not take raises TypeError or ValueError at
    once, an unknown name AttributeError listing the options. Options are read when ``jit``
    traces. The ``JAX_BLINK_*`` variable of each is in the options page's table.

    Attributes:
        timeout_s: Seconds every wait inside a collective may take (``JAX_BLINK_TIMEOUT_S``,
            default 10): a rank that skipped a call gives an error naming it, never a hang.
        chunk_bytes: The pipelining chunk in bytes (>= 16), ``"auto"`` (the tuned chunk of the
            tuning cache) or None, the schedule's default of 512 KiB (``JAX_BLINK_CHUNK_BYTES``).
        fallback: Where no executor can run a call: ``"warn"`` (``lax``, with one warning that
            says why), ``"raise"`` or ``"silent"`` (``JAX_BLINK_FALLBACK``).
        command_buffers: Lower GPU calls to the handler XLA may capture in CUDA graphs: True for
            every call, False for none, ``"auto"`` for the one-hop all-reduces of one process (at
            most 512 KiB per rank; no host channel, whose copy engines cannot be captured)
            (``JAX_BLINK_COMMAND_BUFFERS``, default ``"auto"``).
        dispatch: ``"auto"`` (``lax`` where it was measured faster for that collective, size,
            dtype and machine), ``"blink"`` (always the executor) or ``"lax"``
            (``JAX_BLINK_DISPATCH``, default ``"auto"``).
        merge_bytes: Under the switch, adjacent all-reduces of one dtype merge into calls of at
            most this many bytes per rank; 0 turns merging off (``JAX_BLINK_MERGE_BYTES``,
            default 25 MiB, as DDP's buckets).
        switch_overlap: Under the switch, start the gradient all-reduces of a ``shard_map`` body
            in buckets as soon as their operands exist, and wait where the results are first
            read, so that they run beside the backward pass (``JAX_BLINK_SWITCH_OVERLAP``,
            default True; :mod:`jax_blink.switch.overlap`).
        switch_late_last_wait: With ``switch_overlap``, wait for the last bucket only after
            everything that does not read it, so that the optimizer's update of the other
            buckets' parameters runs beside its kernel (``JAX_BLINK_SWITCH_LATE_LAST_WAIT``,
            default False: slower on 4 x H200 in every model measured, the update and the
            all-reduce slowing each other).
        switch_sparse_gradients: With ``switch_overlap``, an embedding lookup's gradient (a
            scatter-add into zeros) is all-gathered as indices and rows instead of summed dense,
            and a tied embedding's dense part starts early
            (``JAX_BLINK_SWITCH_SPARSE_GRADIENTS``, default False: on 4 x H200 GPT-2 small's step
            was level with it on, 0.9% slower on 2; :mod:`jax_blink.switch.sparse`).
        switch_last_bucket_pieces: With ``switch_overlap``, the last bucket to start (the
            backward pass's last gradients) is cut into this many calls of consecutive operands,
            as :meth:`jax_blink.api.buckets.BucketLayout.of`'s ``last_bucket_pieces`` cuts a
            layout's (``JAX_BLINK_SWITCH_LAST_BUCKET_PIECES``, default 1: the bucket whole). On
            ResNet-50 a call that holds that bucket whole splits XLA's fusions of the residual
            additions with BatchNorm's reductions (0.69 ms of a 36.5 ms step on one H200, nothing
            measurable in 16 pieces), but in the switch's program on 2 x H200 16 pieces made the
            step 0.57-0.83 ms slower: more starts split more (``benchmarks/NOTES.md``, change 32).
            A step whose own buckets are flat buffers needs them cut too: the switch cuts
            between operands, never inside one.
        switch_hold: With ``switch_overlap``, what each start holds back (passes through its
            ``optimization_barrier``): ``"recent"``, the values the backward pass made since the
            previous start, or ``"weights"``, the body's weights that only matrix products and
            convolutions read (:data:`jax_blink.switch.overlap.WEIGHT_READERS`), or ``"none"``,
            nothing (XLA may then sink a start to the end of the step, as it does GPT-2's), as
            :func:`jax_blink.value_and_grad_overlapped`'s ``hold`` (``JAX_BLINK_SWITCH_HOLD``,
            default ``"recent"``; ``benchmarks/NOTES.md``, change 33: on ResNet-50 with no
            communication, ``"none"`` with ``switch_last_bucket_pieces=16`` split 1 of XLA's
            fusions where the holds split 44-47).
        bucket_packing: How the executor's call of several leaves (a bucket of
            :func:`jax_blink.value_and_grad_overlapped`, a merged or overlapped bucket under the
            switch) packs them into its flat operand and back: ``"barrier"`` (XLA's concatenation
            and slices, each leaf first behind an ``optimization_barrier`` of its own, so that XLA
            fuses none of the leaves' producers into the concatenation), ``"xla"`` (the same
            without the barriers) or ``"kernel"`` (one copy kernel each way, ``jax_blink_pack``
            and ``jax_blink_unpack``, on GPUs; CPU devices take XLA's concatenation)
            (``JAX_BLINK_BUCKET_PACKING``, default ``"barrier"``: with ``"xla"``, XLA fused the
            bias and LayerNorm gradients' reductions into GPT-2 medium's packing and the step
            under the switch took 1.34x psum's on 2 and 4 x H200; ``"barrier"`` cost 0.1-0.17 ms
            on GPT-2 small and nothing on ResNet-50; :mod:`jax_blink.lowering.packing`).

    Raises:
        TypeError: An assigned value of the wrong type.
        ValueError: An assigned value the option does not take.
        AttributeError: A name that is not an option.
    """

    timeout_s: float = 10.0
    chunk_bytes: int | str | None = None  # bytes, "auto" (tuned, jax_blink.tools.autotune) or None
    fallback: str = "warn"
    command_buffers: bool | str = AUTO  # True, False, or "auto": the one-hop all-reduces
    dispatch: str = "auto"
    merge_bytes: int = DEFAULT_BUCKET_BYTES  # the switch: most bytes per rank in one merged call; 0: no merging
    switch_overlap: bool = True  # the switch: gradient all-reduces started inside the backward pass
    switch_late_last_wait: bool = False  # the switch: the last bucket's wait after the other updates
    switch_sparse_gradients: bool = False  # the switch: embedding gradients gathered, not summed dense
    switch_last_bucket_pieces: int = 1  # the switch: the last bucket to start, in this many calls
    allreduce_form: str = "auto"  # the planner's choice, or one form of jax_blink/planning/forms.py
    bucket_packing: str = "barrier"  # a bucket's leaves into the executor's flat operand: "barrier", "xla" or "kernel"
    switch_hold: str = "recent"  # the switch: what each start holds back, "recent", "weights" or "none"

    def __setattr__(self, name: str, value) -> None:
        check = _CHECKS.get(name)
        if check is None:
            raise _no_such_option(name)
        object.__setattr__(self, name, check(value))

    def __getattr__(self, name: str):  # only called for names that are not options
        if name.startswith("__"):  # copy, pickle and friends probing for hooks
            raise AttributeError(name)
        raise _no_such_option(name)

    def validate(self) -> None:
        """Check every option again (values set through ``object.__setattr__`` skip the checks)."""
        for name, check in _CHECKS.items():
            check(getattr(self, name))


_UNITS = {"": 0, "k": 10, "m": 20, "g": 30}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def parse_byte_count(text: str) -> int:
    """``"65536"``, ``"512K"``, ``"16M"``, ``"1G"`` (binary units, any case) -> bytes, as the CUDA
    executor reads its byte-count variables; ValueError for anything else."""
    digits, unit = (text[:-1], text[-1:].lower()) if text[-1:].isalpha() else (text, "")
    if not digits.isdigit() or not digits.isascii() or unit not in _UNITS \
            or int(digits) << _UNITS[unit] >= 1 << 63:
        raise ValueError(f"not a byte count: {text!r} (examples: 65536, 512K, 16M, 1G)")
    return int(digits) << _UNITS[unit]


def _parse_whole(text: str) -> int:
    if not text.strip().isascii() or not text.strip().isdigit():
        raise ValueError("not a whole number")
    return int(text)


def _parse_seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("not a number of seconds") from None


def _parse_chunk(text: str) -> int | str:
    return AUTO if text.lower() == AUTO else parse_byte_count(text)


def _parse_flag_or_auto(text: str) -> bool | str:
    if text.lower() == AUTO:
        return AUTO
    try:
        return _parse_flag(text)
    except ValueError:
        raise ValueError(f"not {AUTO}, and not 1/true/yes/on or 0/false/no/off") from None


def _parse_flag(text: str) -> bool:
    if text.lower() not in _TRUE + _FALSE:
        raise ValueError("not 1/true/yes/on or 0/false/no/off")
    return text.lower() in _TRUE


# The variables that set options: name -> (option, parser of its text, what it takes).
_ENV_OPTIONS = {
    "JAX_BLINK_TIMEOUT_S": ("timeout_s", _parse_seconds, f"a number of seconds > 0, at most {MAX_TIMEOUT_S:g}"),
    "JAX_BLINK_CHUNK_BYTES": ("chunk_bytes", _parse_chunk,
                              f"a number of bytes >= {_MIN_CHUNK_BYTES} (65536, 512K, 16M) or {AUTO!r}"),
    "JAX_BLINK_DISPATCH": ("dispatch", str.lower, " / ".join(_DISPATCH)),
    "JAX_BLINK_COMMAND_BUFFERS": ("command_buffers", _parse_flag_or_auto,
                                  f"{AUTO}, 1/true/yes/on or 0/false/no/off"),
    "JAX_BLINK_FALLBACK": ("fallback", str.lower, " / ".join(_FALLBACKS)),
    "JAX_BLINK_MERGE_BYTES": ("merge_bytes", parse_byte_count, "a number of bytes >= 0 (0: no merging; 25M by default)"),
    "JAX_BLINK_ALLREDUCE_FORM": ("allreduce_form", str.lower, " / ".join(ALLREDUCE_FORMS)),
    "JAX_BLINK_SWITCH_OVERLAP": ("switch_overlap", _parse_flag, "1/true/yes/on or 0/false/no/off"),
    "JAX_BLINK_SWITCH_LATE_LAST_WAIT": ("switch_late_last_wait", _parse_flag, "1/true/yes/on or 0/false/no/off"),
    "JAX_BLINK_SWITCH_SPARSE_GRADIENTS": ("switch_sparse_gradients", _parse_flag, "1/true/yes/on or 0/false/no/off"),
    "JAX_BLINK_SWITCH_LAST_BUCKET_PIECES": ("switch_last_bucket_pieces", _parse_whole,
                                            "a whole number >= 1 (1: the bucket whole)"),
    "JAX_BLINK_BUCKET_PACKING": ("bucket_packing", str.lower, " / ".join(BUCKET_PACKINGS)),
    "JAX_BLINK_SWITCH_HOLD": ("switch_hold", str.lower, " / ".join(SWITCH_HOLDS)),
}
# The variables read elsewhere, each where it is used: the tuning cache's file (chunk_cache.py), the
# folder of tuned dispatch entries (dispatch_cache.py), the
# host channel's engine and the executor's size limits that explain() reports (collectives.py), and
# the CUDA executor's own (kernels/cuda/executor.cu, checked at set-up). tests/unit/test_options.py
# scans the package and kernels/ so that this list cannot miss one.
_ENV_ELSEWHERE = (
    "JAX_BLINK_TUNING_CACHE", "JAX_BLINK_DISPATCH_CACHE", "JAX_BLINK_LL_BYTES", "JAX_BLINK_ONESHOT_BYTES", "JAX_BLINK_CUDA_BLOCKS",
    "JAX_BLINK_HOST_MIN_BYTES", "JAX_BLINK_HOST_MAX_BYTES", "JAX_BLINK_HOST_SHARE",
    "JAX_BLINK_HOST_BLOCKS", "JAX_BLINK_HOST_CHUNK_BYTES", "JAX_BLINK_HOST_ENGINE",
    "JAX_BLINK_TWOSHOT_MIN_BYTES",  # kernels/cuda/executor.cu: the two-shot all-reduce on 3+ GPUs
    "JAX_BLINK_TWOSHOT_PIECE_BYTES", "JAX_BLINK_TWOSHOT_MODE",  # its pieces, and remote reads or writes
    "JAX_BLINK_TWOSHOT_REDUCERS",  # its blocks that only reduce
    "JAX_BLINK_LOG_BUFFERS",  # kernels/cuda/executor.cu: debugging, a stderr line per launch naming its buffers
    "JAX_BLINK_TWOSHOT_PUSH",  # its pushes: each peer in turn (serial) or alternating (spread)
    "JAX_BLINK_TWOSHOT_ENGINE",  # its bytes on SMs (sm) or copy engines (ce, kernels/cuda/async_ce.cc)
    "JAX_BLINK_ASYNC_BLOCKS",  # kernels/cuda/async_ffi.cc: the grid of the overlapped (start/done) all-reduce
    "JAX_BLINK_ASYNC_ENGINE",  # kernels/cuda/async_ce.cc: its bytes on copy engines (ce) or SMs (sm)
    "JAX_BLINK_CE_PIECE_BYTES",  # kernels/cuda/async_ce.cc: the pieces its copies and reductions pipeline
    "JAX_BLINK_CE_GATHER",  # kernels/cuda/async_ce.cc: its all-gather reads the peers (pull) or writes them (push)
    "JAX_BLINK_CE_SCATTER",  # kernels/cuda/async_ce.cc: its reduce-scatter likewise
    "JAX_BLINK_IPC_BLOCKS",  # kernels/cuda/ipc.cu: the IPC kernels' most blocks (default: one per SM)
    "JAX_BLINK_SETUP_TIMEOUT_S", "JAX_BLINK_PROCESSES_PER_HOST",  # jax_blink/lowering/processes.py
    "JAX_BLINK_FULL_BINDING",  # jax_blink/api/collectives.py: GPU calls carry every attribute (issue 17)
)
#: Every ``JAX_BLINK_*`` environment variable that jax_blink or its executors read.
KNOWN_ENVIRONMENT = tuple(sorted({*_ENV_OPTIONS, *_ENV_ELSEWHERE}))


def unknown_environment(environ=None) -> list[str]:
    """The ``JAX_BLINK_*`` names in ``environ`` (default ``os.environ``) that nothing reads."""
    environ = os.environ if environ is None else environ
    return sorted(k for k in environ if k.startswith("JAX_BLINK_") and k not in KNOWN_ENVIRONMENT)


def _warn_unknown_environment(environ=None) -> None:
    unknown = unknown_environment(environ)
    if not unknown:
        return
    hints = []
    for name in unknown:
        near = difflib.get_close_matches(name, KNOWN_ENVIRONMENT, n=1, cutoff=0.8)
        hints.append(f"{name} (did you mean {near[0]}?)" if near else name)
    warnings.warn(f"jax_blink ignores the environment variable{'s' * (len(unknown) > 1)} "
                  f"{', '.join(hints)}: not one it reads. The ones it reads: {', '.join(KNOWN_ENVIRONMENT)}",
                  RuntimeWarning, stacklevel=2)


def env_value(name: str, parse, takes: str, default=None, environ=None):
    """Read the ``JAX_BLINK_*`` variable ``name`` through ``parse``.

    The one reader of such variables in Python, for the options and for the others.

    Args:
        name: The variable, e.g. ``"JAX_BLINK_TIMEOUT_S"``.
        parse: Turns the variable's text into its value; raises TypeError or ValueError for text
            it does not take.
        takes: What the variable takes, in words, for the error message.
        default: The value when the variable is unset or empty.
        environ: The environment to read (default ``os.environ``).

    Returns:
        ``parse(text)``, or ``default``.

    Raises:
        ValueError: ``parse`` refused the text; the message names the variable, its value and
            what it takes.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(name, "").strip()
    if not text:  # an empty variable counts as unset, as the CUDA executor reads its own
        return default
    try:
        return parse(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}={environ[name]!r} in the environment: {e}; {name} takes {takes}") from None


def _from_env(environ=None) -> Options:
    """The options as the ``JAX_BLINK_*`` variables of ``environ`` (default ``os.environ``) set
    them; ValueError naming the variable for a value its option does not take."""
    o = Options()
    for name, (field, parse, takes) in _ENV_OPTIONS.items():
        def assign(text: str, field=field, parse=parse) -> None:  # the field's own check counts too
            setattr(o, field, parse(text))
        env_value(name, assign, takes, environ=environ)
    return o


def _started_as_tool() -> bool:
    """Whether this process is jax_blink's command line (``python -m jax_blink...``, ``jax-blink``)."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1].split(".")[0] == "jax_blink"
    return len(argv) > 1 and os.path.basename(argv[1]) == "jax-blink"


#: The options in force. Values are read at trace time: change them before ``jit`` traces.
try:
    config = _from_env()
except ValueError as _e:
    if not _started_as_tool():
        raise
    # The command line reports bad input as one line and exit status 2, this too (it is found
    # while the package imports, before the tool's own error handling exists).
    print(f"jax_blink: error: {_e}", file=sys.stderr)
    raise SystemExit(2) from None
_warn_unknown_environment()


@contextlib.contextmanager
def override(**fields):
    """Set ``config`` fields for the duration of a ``with`` block, restoring them after.

    Options are read when ``jit`` traces: trace inside the block.

    Args:
        **fields: Options and their values, e.g. ``dispatch="lax", timeout_s=30``.

    Yields:
        ``jax_blink.config``, with the fields set.

    Raises:
        AttributeError: A name that is not an option (before any field changes).
        TypeError: A value of the wrong type.
        ValueError: A value the option does not take.

    Example::

        with jax_blink.options.override(dispatch="blink"):
            compiled = jax.jit(step).lower(x).compile()
    """
    saved = {k: getattr(config, k) for k in fields}  # an unknown name raises here, before any change
    try:
        for k, v in fields.items():
            setattr(config, k, v)
        yield config
    finally:
        for k, v in saved.items():
            setattr(config, k, v)
