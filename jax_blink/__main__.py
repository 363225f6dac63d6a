"""``python -m jax_blink``: the command line (jax_blink/tools/cli.py)."""
import sys

from jax_blink.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
