"""A stand-in ``kvikio`` module for tests on hosts without a CUDA driver.

kvikio needs ``libcuda.so.1`` even for host buffers, so where none loads this
module plays its part for :class:`kvtier.io.KvikioRowIO`. It does real
``pread``/``pwrite`` and reproduces what the adapter exists for, as kvikio's
sources state it:

- a read that meets the end of the file raises ``RuntimeError("POSIX error
  on pread: EOF")`` instead of returning a short count
  (``KVIKIO_EXPECT(nbytes_processed != 0, ...)`` in
  ``cpp/include/kvikio/detail/posix_io.hpp``);
- POSIX errors arrive as ``RuntimeError`` with the strerror text, no errno;
- ``defaults`` holds the thread-pool size (``KVIKIO_NTHREADS``, default 1):
  newer releases set it with ``set("num_threads", n)``, older ones with
  ``num_threads_reset(n)`` (their ``set_num_threads`` is a context manager).

The real kvikio runs the RowIO conformance suite (``TestKvikio``) where a
GPU exists.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Callable, Iterator
from typing import Any


class _Future:
    def __init__(self, run: Callable[[], int]) -> None:
        self._run = run

    def get(self) -> int:
        return self._run()


class StandInKvikio(types.ModuleType):
    """``kvikio`` as KvikioRowIO uses it, with kvikio's host-buffer semantics.

    ``CuFile.pread/pwrite(buf, size, off).get()`` loop until ``size`` bytes are
    done, as ``posix_host_io`` (``PartialIO::NO``) does; a read that meets the
    end of the file raises ``RuntimeError("POSIX error on pread: EOF")``; a
    failing call raises ``RuntimeError`` with kvikio's message (``fail``).
    ``before_read`` runs just before a read touches the file (another
    process changing the file between the adapter's ``fstat`` and the read).
    """

    def __init__(self, defaults: Any = None) -> None:
        super().__init__("kvikio")
        self.defaults = defaults if defaults is not None else new_defaults({"num_threads": 1})
        self.calls: list[tuple[str, int, int]] = []
        self.fail: str | None = None
        self.before_read: Callable[[int], None] | None = None
        kv = self

        class CuFile:
            def __init__(self, path: str, flags: str = "r") -> None:
                assert flags == "r+"
                self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

            def _io(self, name: str, buf: Any, size: int, off: int) -> _Future:
                kv.calls.append((name, size, off))

                def run() -> int:
                    if kv.fail is not None:
                        text, kv.fail = kv.fail, None
                        raise RuntimeError(text)
                    if name == "pread" and kv.before_read is not None:
                        kv.before_read(self._fd)
                    view = memoryview(buf).cast("B")[:size]
                    done = 0
                    while done < size:
                        if name == "pread":
                            n = os.preadv(self._fd, [view[done:]], off + done)
                            if n == 0:
                                raise RuntimeError("POSIX error on pread: EOF")
                        else:
                            n = os.pwritev(self._fd, [view[done:]], off + done)
                        done += n
                    return size

                return _Future(run)

            def pread(self, buf: Any, size: int, file_offset: int = 0) -> _Future:
                return self._io("pread", buf, size, file_offset)

            def pwrite(self, buf: Any, size: int, file_offset: int = 0) -> _Future:
                return self._io("pwrite", buf, size, file_offset)

            def close(self) -> None:
                os.close(self._fd)

        self.CuFile = CuFile


def new_defaults(threads: dict[str, int]) -> types.SimpleNamespace:
    """kvikio >= 25.04's ``defaults``: ``get(name)``, and ``set(name, value)``
    which applies at once and returns a context manager (that restores the
    old value only when used in a ``with``)."""
    ns = types.SimpleNamespace()
    ns.get = lambda name: threads[name]

    def set_(name: str, value: int) -> contextlib.AbstractContextManager[None]:
        old = threads[name]
        threads[name] = value

        @contextlib.contextmanager
        def restore() -> Iterator[None]:
            try:
                yield
            finally:
                threads[name] = old

        return restore()

    ns.set = set_
    ns.threads = threads
    return ns


def defaults_2502(threads: dict[str, int]) -> types.SimpleNamespace:
    """kvikio <= 25.02's ``defaults`` (python/kvikio/kvikio/defaults.py of those
    releases): ``get_num_threads()``, ``num_threads_reset(n)`` that sets the
    pool size, and ``set_num_threads(n)``, a ``@contextlib.contextmanager``
    that resets the pool only inside a ``with`` block."""
    ns = types.SimpleNamespace()
    ns.get_num_threads = lambda: threads["num_threads"]

    def num_threads_reset(n: int) -> None:
        threads["num_threads"] = n

    @contextlib.contextmanager
    def set_num_threads(n: int) -> Iterator[None]:
        old = threads["num_threads"]
        try:
            num_threads_reset(n)
            yield
        finally:
            num_threads_reset(old)

    ns.num_threads_reset = num_threads_reset
    ns.set_num_threads = set_num_threads
    ns.threads = threads
    return ns
