"""The one module that owns direct-I/O alignment rules (address, length, offset).

O_DIRECT on Linux (ext4, xfs) requires the buffer address, the request length
and the file offset to be multiples of the logical block size. kvtier uses 4 KiB
for all three everywhere, which is a multiple of every common block size.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import TYPE_CHECKING

from kvtier.errors import AlignmentError

if TYPE_CHECKING:
    import torch

__all__ = ["ALIGN", "buffer_address", "check_direct", "is_aligned", "round_up"]

ALIGN = 4096
"""Alignment in bytes of every direct-I/O address, length and file offset."""


def round_up(n: int, a: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``a``.

    Args:
        n: a byte count (``>= 0``).
        a: the alignment in bytes (``> 0``), 4096 by default.

    Returns:
        The smallest multiple of ``a`` that is ``>= n``.

    """
    return -(-n // a) * a


def is_aligned(n: int, a: int = ALIGN) -> bool:
    """Whether ``n`` (an address, length or offset in bytes) is a multiple of ``a``."""
    return n % a == 0


class _PyBuffer(ctypes.Structure):
    """``Py_buffer`` from CPython's ``Include/pybuffer.h`` (stable since 3.3)."""

    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    )


_api = ctypes.PyDLL(None)
_get_buffer = _api.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_get_buffer.restype = ctypes.c_int
_release_buffer = _api.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)
_release_buffer.restype = None


def buffer_address(buf: memoryview | torch.Tensor) -> int:
    """Return the address of the first byte of a buffer.

    Args:
        buf: a C-contiguous ``memoryview`` (read-only or writable, e.g. a slice
            of an ``mmap`` or of a CPU ``uint8`` tensor's buffer), or a
            contiguous CPU ``torch.Tensor``. Other buffer-protocol objects work too.

    Returns:
        The virtual address as an int.

    Raises:
        BufferError: the buffer is not C-contiguous.
        TypeError: ``buf`` supports no buffer protocol and is no tensor.

    """
    if isinstance(buf, memoryview):
        if not buf.readonly and buf.nbytes:
            # Fast path (0.2 us instead of 0.9 us; two calls per row written):
            # ctypes takes writable buffers only, at least one byte long.
            with contextlib.suppress(TypeError, ValueError, BufferError):
                return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    else:
        data_ptr = getattr(buf, "data_ptr", None)
        if data_ptr is not None:
            return int(data_ptr())
    view = _PyBuffer()
    _get_buffer(buf, ctypes.byref(view), 0)  # PyBUF_SIMPLE: contiguous bytes
    try:
        return int(view.buf or 0)
    finally:
        _release_buffer(ctypes.byref(view))


def check_direct(buf_address: int, nbytes: int, file_offset: int) -> None:
    """Check one direct-I/O request (or one iovec of it) for 4 KiB alignment.

    Args:
        buf_address: the buffer's address in bytes.
        nbytes: the request length in bytes.
        file_offset: the file offset in bytes.

    Raises:
        AlignmentError: naming each of ``address``, ``length``, ``offset`` that
            is not a multiple of :data:`ALIGN`.

    """
    bad = [
        f"{name}={value:#x}"
        for name, value in (
            ("address", buf_address),
            ("length", nbytes),
            ("offset", file_offset),
        )
        if value % ALIGN
    ]
    if bad:
        raise AlignmentError(
            f"direct I/O needs {ALIGN}-byte alignment; misaligned: {', '.join(bad)}"
        )
