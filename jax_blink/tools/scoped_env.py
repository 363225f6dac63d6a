"""Environment variables set for a block of code: the CUDA executor reads some of its knobs once
per call site, at the site's first run, so a tool sets them around that run only."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def environment(env: dict[str, str] | None) -> Iterator[None]:
    """``env`` set in ``os.environ`` inside the block, the earlier values (or their absence) back
    after it; None or {} sets nothing."""
    env = env or {}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
