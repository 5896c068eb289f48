"""A Triton copy kernel that executes a descriptor table: one program per row.

Program ``i`` copies ``nbytes[i]`` bytes from address ``src[i]`` to address
``dst[i]`` in elements of the table's width (1, 2, 4 or 8 bytes; 16-byte
widths copy as two 8-byte elements), ``BLOCK`` elements per step. On CPU
tensors it runs under Triton's interpreter (``TRITON_INTERPRET=1``), which
is how the suite checks it on the plans of its layouts; a grid of one
program per row works there, a persistent loop over ``tl.num_programs``
does not (the interpreter crashed).

Triton is imported on first use: it is an optional dependency.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import numpy as np
import torch

from kvtier._copytable import CopyTable
from kvtier.errors import ConfigError

_BLOCK = 256
"""Elements each program moves per step (a power of two)."""

_LAUNCH = threading.Lock()
"""One launch at a time: Triton's interpreter patches ``triton.language`` for
the duration of a launch, process-wide, so a second thread's launch that ends
meanwhile restores it under the first (which then fails)."""


def available() -> str | None:
    """Why the kernel cannot run on CPU tensors here, or ``None`` when it can.

    Returns:
        ``None``, or the reason: Triton is not installed, or
        ``TRITON_INTERPRET=1`` is not set (CPU tensors run only under the
        interpreter).
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton)"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1"
    return None


def require() -> None:
    """Raise unless the kernel can run here.

    Raises:
        ConfigError: it cannot (:func:`available` says why).
    """
    reason = available()
    if reason is not None:
        raise ConfigError(f"kvtier: copy_backend='kernel': {reason}")


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def copy_rows(src_ptr, dst_ptr, n_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        row = tl.program_id(0)
        if WIDTH == 8:
            kind = tl.pointer_type(tl.int64)
        elif WIDTH == 4:
            kind = tl.pointer_type(tl.int32)
        elif WIDTH == 2:
            kind = tl.pointer_type(tl.int16)
        else:
            kind = tl.pointer_type(tl.int8)
        src = tl.load(src_ptr + row).to(kind)
        dst = tl.load(dst_ptr + row).to(kind)
        n = tl.load(n_ptr + row)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return copy_rows


def execute_kernel(table: CopyTable) -> None:
    """Copy every row of ``table`` with the Triton kernel (CPU tensors, interpreter).

    Rows must not overlap on the destination side: programs run in no
    defined order.

    Raises:
        ConfigError: the kernel cannot run here (:func:`available`).
    """
    require()
    n = len(table.nbytes)
    if not n:
        return
    width = min(table.width, 8)
    rows = torch.from_numpy(
        np.stack([table.src + table.lo, table.dst + table.lo, table.nbytes // width])
    )
    with _LAUNCH:
        _kernel()[(n,)](rows[0], rows[1], rows[2], WIDTH=width, BLOCK=_BLOCK)
