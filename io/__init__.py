"""kvtier.io: the NVMe tier (row format, RowIO backends, segment files, index).

The engine uses :class:`NVMeTier` only; :class:`RowIO` backends and
:func:`select_backend` are public for tests, benchmarks and custom backends.
"""

from kvtier.io._format import FORMAT_VERSION, format_digest
from kvtier.io._inspect import inspect_root
from kvtier.io._remove import remove_namespace
from kvtier.io._rowio import AioRowIO, KvikioRowIO, PosixRowIO, RowIO, select_backend
from kvtier.io._tier import NVMeTier

__all__ = [  # noqa: RUF022 - plain sorted() order, checked by a test
    "AioRowIO",
    "FORMAT_VERSION",
    "KvikioRowIO",
    "NVMeTier",
    "PosixRowIO",
    "RowIO",
    "format_digest",
    "inspect_root",
    "remove_namespace",
    "select_backend",
]
