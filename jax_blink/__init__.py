"""jax_blink: Blink-style collectives for JAX.

Probe the links between the devices of a mesh axis, pack spanning trees into that graph with
OR-Tools at trace time, and run them as an XLA custom call::

    out = jax_blink.all_reduce(x, "data")   # where you wrote lax.psum(x, "data")

The package is built in layers, each importing only the layers below it:
``options`` (settings and the environment) < ``planning`` (topology, tree packing, schedule; no
JAX) < ``lowering`` (dispatch, the custom call, processes and hosts) < ``switch`` (lax collectives
of unedited programs) < ``api`` (the public calls) < ``tools`` (command line, bench, pictures,
training; imported by nothing in the library).
"""
from jax_blink.api.collectives import (SUPPORTED_DTYPES, AllReduceHandle, all_gather, all_reduce,
                                       all_reduce_done, all_reduce_start, backends, broadcast, check,
                                       check_environment, reduce, reduce_scatter, reset)
from jax_blink.api.explain import explain
from jax_blink.api.overlapped_grad import value_and_grad_overlapped
from jax_blink.lowering.call_order import register as _register_call_order
from jax_blink.options import config
from jax_blink.planning.packing import Plan, plan
from jax_blink.planning.topology import Topology
from jax_blink.switch import explain_lowering, install, installed, is_installed, switch_report, uninstall

__version__ = "0.1.0"

# On CPU, loops, conds and nested jits that hold jax_blink calls join the chain of the calls
# around them (jax_blink/lowering/call_order.py): lowering rules in force while jax_blink is imported.
_register_call_order()

__all__ = [
    "AllReduceHandle", "Plan", "SUPPORTED_DTYPES", "Topology", "all_gather", "all_reduce", "all_reduce_done",
    "all_reduce_start", "backends", "broadcast",
    "check", "check_environment", "config", "explain", "plan", "reduce", "reduce_scatter", "reset",
    "value_and_grad_overlapped",
    # the switch (jax_blink/switch/): lax collectives of unedited programs on jax_blink
    "explain_lowering", "install", "installed", "is_installed", "switch_report", "uninstall",
]
