"""Runs JAX's own test cases twice, without jax_blink's switch and with it, and compares.

Collected only when ``JAX_BLINK_PORTED=1`` (tests/unit/test_switch_ported.py sets it and picks the
cases); the normal test run ignores this folder. Each selected test method runs once as jax's
test suite runs it, then again inside ``jax_blink.installed()`` with ``dispatch="blink"`` (so that
every collective jax_blink can run does run on it, whatever the size). The test passes when both
runs end the same way (both pass, or both skip); it fails when they differ, naming both endings.
Per test, the switch's decisions and the number of executor communicators that came to life
(proof that the custom call ran) are written as JSON to ``JAX_BLINK_PORTED_REPORT``.
"""
from __future__ import annotations

import json
import os
import traceback
import unittest

import pytest

ENABLED = os.environ.get("JAX_BLINK_PORTED") == "1"
if not ENABLED:
    collect_ignore_glob = ["*_test.py"]

_records: dict[str, dict] = {}


def _ending(fn) -> tuple[str, str]:
    """("passed" | "skipped" | "failed", detail) of calling ``fn``."""
    try:
        fn()
    except unittest.SkipTest as e:
        return "skipped", str(e)
    except pytest.skip.Exception as e:
        return "skipped", str(e)
    except BaseException as e:  # noqa: BLE001  (any ending is compared, KeyboardInterrupt aside)
        if isinstance(e, KeyboardInterrupt):
            raise
        return "failed", "".join(traceback.format_exception_only(type(e), e)).strip()
    return "passed", ""


def _twin(test_id: str, method):
    def run_twice(self):
        import jax_blink
        from jax_blink.lowering import backends as _backends
        from jax_blink.options import override

        plain = _ending(lambda: method(self))
        cpu = _backends.module("cpu")
        jax_blink.switch_report(clear=True)
        comms_before = cpu.num_comms()
        with jax_blink.installed(), override(dispatch="blink"):
            switched = _ending(lambda: method(self))
        decisions = jax_blink.switch_report(clear=True)
        _records[test_id] = {
            "plain": plain[0], "switched": switched[0],
            "plain_detail": plain[1][:500], "switched_detail": switched[1][:500],
            "executor_comms": cpu.num_comms() - comms_before,
            "decisions": [{"primitive": d.primitive, "runs_on": d.runs_on, "reason": d.reason,
                           "dtype": d.dtype} for d in decisions],
        }
        _write_report()  # after every case, so that a run cut short still leaves its record
        if plain[0] != switched[0]:
            raise AssertionError(f"without the switch: {plain[0]} {plain[1]!r}; "
                                 f"with it: {switched[0]} {switched[1]!r}")
        if plain[0] == "skipped":
            raise unittest.SkipTest(plain[1])
        if plain[0] == "failed":
            raise AssertionError(f"fails without the switch too: {plain[1]}")

    return run_twice


def pytest_pycollect_makeitem(collector, name, obj):
    """Wrap every test method of a collected unittest class, before pytest makes its items."""
    if not (ENABLED and isinstance(obj, type) and issubclass(obj, unittest.TestCase)):
        return None
    if not obj.__dict__.get("_jax_blink_twinned"):
        for attr in dir(obj):
            method = getattr(obj, attr)
            if attr.startswith("test") and callable(method):
                setattr(obj, attr, _twin(f"{obj.__module__}::{obj.__name__}::{attr}", method))
        obj._jax_blink_twinned = True
    return None  # pytest collects the class as usual


def _write_report() -> None:
    path = os.environ.get("JAX_BLINK_PORTED_REPORT")
    if ENABLED and path:
        with open(path + ".tmp", "w") as f:
            json.dump(_records, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)


def pytest_sessionfinish(session, exitstatus):
    _write_report()
