"""jax_blink.config: every assignment checked, unknown names refused, override() restoring, the
environment parsed with errors that name the variable, and misspelled JAX_BLINK_* names warned of."""
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import jax_blink
from jax_blink.options import settings as options

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh():
    """A fresh Options (the checks are the same as on jax_blink.config, which tests leave alone)."""
    return options.Options()


# What each option takes, and a table of values it refuses with the error class and the words the
# message must contain (the option's name, the value, what it takes).
GOOD = {
    "timeout_s": [(0.5, 0.5), (3, 3.0), (np.float32(2.0), 2.0), (options.MAX_TIMEOUT_S, 1e6)],
    "chunk_bytes": [(None, None), ("auto", "auto"), (16, 16), (1 << 20, 1 << 20), (np.int64(4096), 4096)],
    "dispatch": [("auto", "auto"), ("blink", "blink"), ("lax", "lax")],
    "fallback": [("warn", "warn"), ("raise", "raise"), ("silent", "silent")],
    "command_buffers": [(True, True), (False, False), (np.bool_(True), True), ("auto", "auto")],
    "merge_bytes": [(0, 0), (25 << 20, 25 << 20), (np.int64(4096), 4096)],
    "switch_overlap": [(True, True), (False, False), (np.bool_(False), False)],
    "switch_late_last_wait": [(True, True), (False, False)],
    "switch_sparse_gradients": [(True, True), (False, False)],
    "switch_last_bucket_pieces": [(1, 1), (16, 16), (np.int64(4), 4)],
    "bucket_packing": [("barrier", "barrier"), ("xla", "xla"), ("kernel", "kernel")],
    "switch_hold": [("recent", "recent"), ("weights", "weights"), ("none", "none")],
    "allreduce_form": [("auto", "auto"), ("rings", "rings"), ("shallow_trees", "shallow_trees")],
}
BAD = [
    ("timeout_s", "abc", TypeError, "number of seconds"),
    ("timeout_s", True, TypeError, "number of seconds"),
    ("timeout_s", None, TypeError, "number of seconds"),
    ("timeout_s", 0, ValueError, "> 0 and at most"),
    ("timeout_s", -1.5, ValueError, "> 0 and at most"),
    ("timeout_s", math.nan, ValueError, "> 0 and at most"),
    ("timeout_s", math.inf, ValueError, "> 0 and at most"),
    ("timeout_s", 2e6, ValueError, "> 0 and at most"),
    ("chunk_bytes", -5, ValueError, ">= 16"),
    ("chunk_bytes", 8, ValueError, ">= 16"),
    ("chunk_bytes", 1 << 63, ValueError, ">= 16"),
    ("chunk_bytes", "4096", ValueError, "whole number of bytes"),
    ("chunk_bytes", "big", ValueError, "'auto'"),
    ("chunk_bytes", 4096.0, TypeError, "whole number of bytes"),
    ("chunk_bytes", True, TypeError, "whole number of bytes"),
    ("chunk_bytes", [4096], TypeError, "whole number of bytes"),
    ("chunk_bytes", np.array([4096]), TypeError, "whole number of bytes"),
    ("dispatch", "fast", ValueError, "'auto', 'blink', 'lax'"),
    ("dispatch", "LAX", ValueError, "'auto', 'blink', 'lax'"),
    ("dispatch", None, TypeError, "'auto', 'blink', 'lax'"),
    ("fallback", "loud", ValueError, "'warn', 'raise', 'silent'"),
    ("fallback", 1, TypeError, "'warn', 'raise', 'silent'"),
    ("command_buffers", 1, TypeError, "True, False or 'auto'"),
    ("command_buffers", "yes", TypeError, "True, False or 'auto'"),
    ("merge_bytes", -1, ValueError, ">= 0"),
    ("merge_bytes", 1.5, TypeError, "whole number of bytes"),
    ("merge_bytes", True, TypeError, "whole number of bytes"),
    ("merge_bytes", "25M", TypeError, "whole number of bytes"),
    ("switch_overlap", 1, TypeError, "True or False"),
    ("switch_overlap", "on", TypeError, "True or False"),
    ("switch_late_last_wait", 0, TypeError, "switch_late_last_wait must be True or False"),
    ("switch_sparse_gradients", "yes", TypeError, "switch_sparse_gradients must be True or False"),
    ("switch_last_bucket_pieces", 0, ValueError, "switch_last_bucket_pieces must be >= 1"),
    ("switch_last_bucket_pieces", 2.0, TypeError, "switch_last_bucket_pieces must be a whole number"),
    ("switch_last_bucket_pieces", True, TypeError, "switch_last_bucket_pieces must be a whole number"),
    ("bucket_packing", "kernels", ValueError, "bucket_packing must be one of ('barrier', 'xla', 'kernel')"),
    ("bucket_packing", True, TypeError, "bucket_packing must be one of"),
    ("switch_hold", "all", ValueError, "switch_hold must be one of ('recent', 'weights', 'none')"),
    ("allreduce_form", "ring", ValueError, "'auto', 'reduce_broadcast', 'rings'"),
    ("allreduce_form", None, TypeError, "'auto', 'reduce_broadcast', 'rings'"),
]


def test_the_tables_cover_every_option():
    fields = {f.name for f in options.dataclasses.fields(options.Options)}
    assert set(GOOD) == fields and {b[0] for b in BAD} == fields


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_values_are_stored_as_plain_python(fresh, name):
    for value, stored in GOOD[name]:
        setattr(fresh, name, value)
        got = getattr(fresh, name)
        assert got == stored and type(got) is type(stored)
        fresh.validate()


@pytest.mark.parametrize("name,value,error,words", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_a_bad_value_is_refused_on_assignment(fresh, name, value, error, words):
    before = getattr(fresh, name)
    with pytest.raises(error) as info:
        setattr(fresh, name, value)
    message = str(info.value)
    assert name in message and repr(value) in message and words in message
    assert getattr(fresh, name) == before  # nothing changed
    with pytest.raises(error):  # the constructor checks the same way
        options.Options(**{name: value})


def test_the_issue_cases_on_jax_blink_config():
    config = jax_blink.config
    before = options.dataclasses.asdict(config)
    with pytest.raises(TypeError, match=r"timeout_s must be a number of seconds .*got 'abc' \(str\)"):
        config.timeout_s = "abc"
    with pytest.raises(ValueError, match=r"dispatch must be one of \('auto', 'blink', 'lax'\), got 'fast'"):
        config.dispatch = "fast"
    with pytest.raises(ValueError, match="chunk_bytes must be >= 16 bytes .*got -5"):
        config.chunk_bytes = -5
    with pytest.raises(AttributeError, match="no option 'foo'; the options are: timeout_s, chunk_bytes, merge_bytes, "
                                             "fallback, command_buffers, dispatch"):
        config.foo = 1
    with pytest.raises(AttributeError, match=r"no option 'timout_s' \(did you mean 'timeout_s'\?\)"):
        config.timout_s = 5
    with pytest.raises(AttributeError, match="no option 'foo'"):
        config.foo  # noqa: B018  (reading an unknown name says the same)
    assert options.dataclasses.asdict(config) == before
    assert not hasattr(config, "foo")


def test_validate_catches_values_that_skipped_the_checks(fresh):
    object.__setattr__(fresh, "dispatch", "fast")
    with pytest.raises(ValueError, match="dispatch must be one of"):
        fresh.validate()


def test_override_sets_restores_and_restores_on_error():
    config = jax_blink.config
    before = options.dataclasses.asdict(config)
    with options.override(timeout_s=2.5, dispatch="lax") as c:
        assert c is config and config.timeout_s == 2.5 and config.dispatch == "lax"
    assert options.dataclasses.asdict(config) == before
    # A bad value in the middle: the fields set before it are restored, the error is the field's own.
    with pytest.raises(ValueError, match="chunk_bytes must be >= 16"):
        with options.override(timeout_s=3.0, chunk_bytes=-5, dispatch="lax"):
            pytest.fail("the block must not run")
    assert options.dataclasses.asdict(config) == before
    with pytest.raises(RuntimeError, match="inside"):  # an error inside the block
        with options.override(dispatch="blink"):
            raise RuntimeError("inside")
    assert options.dataclasses.asdict(config) == before
    with pytest.raises(AttributeError, match="no option 'dispach'"):  # nothing set at all
        with options.override(timeout_s=4.0, dispach="lax"):
            pass
    assert options.dataclasses.asdict(config) == before


# --------------------------------------------------------------------------------------------
# The environment

def test_options_from_the_environment():
    env = {"JAX_BLINK_TIMEOUT_S": " 2.5 ", "JAX_BLINK_CHUNK_BYTES": "512K", "JAX_BLINK_DISPATCH": " LAX ",
           "JAX_BLINK_COMMAND_BUFFERS": "ON", "JAX_BLINK_FALLBACK": "Raise"}
    o = options._from_env(env)
    assert (o.timeout_s, o.chunk_bytes, o.dispatch, o.command_buffers, o.fallback) == \
        (2.5, 512 << 10, "lax", True, "raise")
    assert options._from_env({"JAX_BLINK_CHUNK_BYTES": "AUTO"}).chunk_bytes == "auto"
    assert options._from_env({"JAX_BLINK_CHUNK_BYTES": "65536"}).chunk_bytes == 65536
    # An empty variable counts as unset (as the CUDA executor reads its own).
    assert options._from_env({k: "" for k in env}) == options.Options()
    for text, want in (("1", True), ("yes", True), ("off", False), ("0", False)):
        assert options._from_env({"JAX_BLINK_COMMAND_BUFFERS": text}).command_buffers is want
    assert options._from_env({"JAX_BLINK_COMMAND_BUFFERS": "Auto"}).command_buffers == "auto"
    assert options.Options().command_buffers == "auto"  # the default
    assert options._from_env({"JAX_BLINK_MERGE_BYTES": "0"}).merge_bytes == 0
    assert options._from_env({"JAX_BLINK_MERGE_BYTES": "4M"}).merge_bytes == 4 << 20
    assert options._from_env({"JAX_BLINK_SWITCH_LAST_BUCKET_PIECES": " 16 "}).switch_last_bucket_pieces == 16
    assert options._from_env({"JAX_BLINK_SWITCH_HOLD": "Weights"}).switch_hold == "weights"


@pytest.mark.parametrize("name,text,words", [
    ("JAX_BLINK_TIMEOUT_S", "soon", "not a number of seconds"),
    ("JAX_BLINK_TIMEOUT_S", "0", "timeout_s must be > 0"),
    ("JAX_BLINK_TIMEOUT_S", "inf", "timeout_s must be > 0 and at most"),
    ("JAX_BLINK_TIMEOUT_S", "nan", "timeout_s must be > 0 and at most"),
    ("JAX_BLINK_TIMEOUT_S", "1e17", "timeout_s must be > 0 and at most"),
    ("JAX_BLINK_CHUNK_BYTES", "lots", "not a byte count"),
    ("JAX_BLINK_CHUNK_BYTES", "16MB", "not a byte count"),
    ("JAX_BLINK_CHUNK_BYTES", "-4096", "not a byte count"),
    ("JAX_BLINK_CHUNK_BYTES", "1.5M", "not a byte count"),
    ("JAX_BLINK_CHUNK_BYTES", "８", "not a byte count"),
    ("JAX_BLINK_CHUNK_BYTES", "8", "chunk_bytes must be >= 16"),
    ("JAX_BLINK_DISPATCH", "fast", "dispatch must be one of"),
    ("JAX_BLINK_FALLBACK", "loud", "fallback must be one of"),
    ("JAX_BLINK_COMMAND_BUFFERS", "maybe", "not 1/true/yes/on or 0/false/no/off"),
    ("JAX_BLINK_MERGE_BYTES", "-1", "not a byte count"),
    ("JAX_BLINK_SWITCH_LAST_BUCKET_PIECES", "many", "not a whole number"),
    ("JAX_BLINK_SWITCH_LAST_BUCKET_PIECES", "-2", "not a whole number"),
    ("JAX_BLINK_SWITCH_LAST_BUCKET_PIECES", "0", "switch_last_bucket_pieces must be >= 1"),
])
def test_a_bad_environment_value_names_the_variable(name, text, words):
    with pytest.raises(ValueError) as info:
        options._from_env({name: text})
    message = str(info.value)
    assert message.startswith(f"{name}={text!r} in the environment: ") and words in message
    assert f"{name} takes " in message


def test_parse_byte_count():
    assert options.parse_byte_count("16M") == 16 << 20 and options.parse_byte_count("7") == 7
    assert options.parse_byte_count("1g") == 1 << 30
    with pytest.raises(ValueError, match="not a byte count"):
        options.parse_byte_count("8589934592G")  # past int64, as the executor refuses it


def _read_environment_names() -> set[str]:
    """Every JAX_BLINK_* name that the package (options.py's own list aside) or the executors
    mention, less C macros: the variables something reads."""
    sources = [p for p in ROOT.glob("jax_blink/**/*.py") if p.name != "settings.py"]
    sources += [*ROOT.glob("kernels/**/*.c*"), *ROOT.glob("kernels/**/*.h")]
    names, macros = set(), set()
    for path in sources:
        text = path.read_text()
        names |= set(re.findall(r"\bJAX_BLINK_[A-Z0-9_]+\b", text))
        macros |= set(re.findall(r"#define\s+(JAX_BLINK_[A-Z0-9_]+)", text))
        macros |= {"JAX_BLINK_CUDA_ARCHS"}  # a CMake setting of the build (README, "Building for GPUs"), no variable
    return names - macros


def test_the_known_environment_is_every_variable_read():
    read = _read_environment_names() | set(options._ENV_OPTIONS)  # options.py reads its own
    assert {"JAX_BLINK_ONESHOT_BYTES", "JAX_BLINK_TUNING_CACHE", "JAX_BLINK_HOST_ENGINE"} <= read  # the scan works
    assert sorted(read - set(options.KNOWN_ENVIRONMENT)) == []  # read somewhere, not listed
    assert sorted(set(options.KNOWN_ENVIRONMENT) - read) == []  # listed, read nowhere (stale)


def test_unknown_environment_names():
    env = {"JAX_BLINK_TIMOUT_S": "5", "JAX_BLINK_DISPATCH": "lax", "JAX_BLINK_WHATEVER": "1", "PATH": "/bin"}
    assert options.unknown_environment(env) == ["JAX_BLINK_TIMOUT_S", "JAX_BLINK_WHATEVER"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options._warn_unknown_environment(env)
        options._warn_unknown_environment({"JAX_BLINK_DISPATCH": "lax"})  # all known: no warning
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "JAX_BLINK_TIMOUT_S (did you mean JAX_BLINK_TIMEOUT_S?)" in text
    assert "JAX_BLINK_WHATEVER" in text and "JAX_BLINK_WHATEVER (did" not in text
    assert all(name in text for name in options.KNOWN_ENVIRONMENT)


def test_a_misspelled_variable_warns_once_per_process():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_BLINK_")}
    env.update(JAX_BLINK_TIMOUT_S="5", PYTHONWARNINGS="always", JAX_PLATFORMS="cpu")
    code = ("import jax_blink, jax_blink.options, jax_blink.api.collectives, importlib\n"
            "import jax_blink.tools.autotune, jax_blink.tools.bench\n"
            "assert jax_blink.config.timeout_s == 10.0\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("JAX_BLINK_TIMOUT_S (did you mean JAX_BLINK_TIMEOUT_S?)") == 1, out.stderr
    assert out.stderr.count("RuntimeWarning") == 1, out.stderr
