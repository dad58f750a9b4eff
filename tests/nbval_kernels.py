"""A pytest plugin for the notebook steps of ``tasks.py test`` (``-p tests.nbval_kernels``):
a kernel that dies while starting is started again, up to TRIES times.

On a loaded 2-core machine (two CI runs side by side) a notebook's kernel can die before it
replies to kernel_info; nbval then fails every cell of that notebook, which says nothing
about the notebook. A kernel that starts and then fails a cell is not retried: only the
start is."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

TRIES = 3
PAUSE_S = 2.0  # before the next try, times the tries so far


def start_with_retries(start: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``start(*args, **kwargs)``, again after a pause when it raises RuntimeError (what
    jupyter_client raises for a kernel that died or did not answer while starting)."""
    for attempt in range(1, TRIES + 1):
        try:
            return start(*args, **kwargs)
        except RuntimeError as exc:
            if attempt == TRIES:
                raise
            print(f"\nkernel failed to start ({exc}); starting it again "
                  f"({attempt + 1} of {TRIES})", flush=True)
            time.sleep(PAUSE_S * attempt)
    raise AssertionError("unreachable")


def pytest_configure(config: Any) -> None:
    import nbval.kernel

    original = nbval.kernel.start_new_kernel
    if getattr(original, "retries", False):
        return

    def start_new_kernel(*args: Any, **kwargs: Any) -> Any:
        return start_with_retries(original, *args, **kwargs)

    start_new_kernel.retries = True  # type: ignore[attr-defined]
    nbval.kernel.start_new_kernel = start_new_kernel
