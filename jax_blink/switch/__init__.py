"""Layer 3, the switch: XLA's own collectives of unedited programs lowered to jax_blink's executor."""
from jax_blink.switch.rules import (explain_lowering, install, installed, is_installed, run_script,
                                    switch_report, uninstall)

__all__ = ["explain_lowering", "install", "installed", "is_installed", "run_script", "switch_report",
           "uninstall"]
