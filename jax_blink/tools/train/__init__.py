"""Data-parallel training with jax_blink: ``python -m jax_blink.tools.train`` (a tool above the library;
nothing in the library imports it). Needs the ``train`` extra: ``pip install -e ".[train]"``
(flax, optax).

:mod:`.models` (ResNet-18 and GPT-2 shaped, flax NNX), :mod:`.data` (synthetic data),
:mod:`.step` (the data-parallel step of each collective mode), :mod:`.__main__` (the command).
"""
