"""jax_blink: Blink-style collectives for JAX.

Probe the links between the devices of a mesh axis, pack spanning trees into that graph with
OR-Tools at trace time, and run them as an XLA custom call::

    out = jax_blink.all_reduce(x, "data")   # where you wrote lax.psum(x, "data")
"""
from .collectives import (SUPPORTED_DTYPES, all_gather, all_reduce, backends, broadcast, check,
                          explain, reduce, reduce_scatter)
from .call_order import register as _register_call_order
from .options import config
from .switch import explain_lowering, install, installed, is_installed, switch_report, uninstall
from .topology import Topology
from .treegen import Plan, plan

__version__ = "0.1.0"

# On CPU, loops, conds and nested jits that hold jax_blink calls join the chain of the calls
# around them (jax_blink/call_order.py): lowering rules in force while jax_blink is imported.
_register_call_order()

__all__ = [
    "Plan", "SUPPORTED_DTYPES", "Topology", "all_gather", "all_reduce", "backends", "broadcast",
    "check", "config", "explain", "plan", "reduce", "reduce_scatter",
    # the switch (jax_blink/switch.py): lax collectives of unedited programs on jax_blink
    "explain_lowering", "install", "installed", "is_installed", "switch_report", "uninstall",
]
