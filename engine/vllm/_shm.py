"""The CPU slot memory that vLLM's two processes share, with nothing left on disk.

The model worker makes the memory: an anonymous ``memfd`` (no name in any
filesystem, ``/dev/shm`` included), mapped ``MAP_SHARED`` into a
:class:`~kvtier._slots.HostRegion` and page-locked there on CUDA hosts. It
then serves the descriptor, with a small JSON header describing the slots,
on a Linux *abstract* Unix socket named after vLLM's engine id and the rank
(an abstract socket is not a file either: it disappears with its last
descriptor). The scheduler process connects, receives the descriptor
(``SCM_RIGHTS``), maps it, and closes its copy of the descriptor.

Nothing of this outlives the processes: a SIGKILLed vLLM leaves no
shared-memory file, socket file or lock file, so there is nothing to sweep at
the next start. The pages are freed by the kernel when the last mapping
goes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import struct
import threading
import time
from typing import Any

from kvtier._slots import HostRegion
from kvtier.errors import ConfigError, KVTierError

log = logging.getLogger("kvtier")

_HEADER_MAX = 1 << 20


class RendezvousError(KVTierError):
    """The scheduler process could not obtain the slot memory from the model worker."""


def socket_name(engine_id: str, rank: int) -> bytes:
    """The abstract socket address of an engine's rank (leading NUL: not a file).

    The engine id is hashed so that any id fits the 108-byte address.
    """
    digest = hashlib.blake2b(f"{engine_id}/{rank}".encode(), digest_size=16).hexdigest()
    return b"\0kvtier-slots-" + digest.encode()


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


class SlotMemoryServer:
    """Worker side: the slot memory, and the socket that hands it to the scheduler.

    Args:
        engine_id: vLLM's engine id (the same string in both processes).
        rank: the worker's rank.
        nbytes: bytes of the region (a multiple of 4096, ``> 0``).
        header: JSON-able description of the slots sent with the descriptor.
        pin: page-lock the region for the GPU (CUDA hosts).

    Raises:
        ConfigError: the region cannot be made (the message says why:
            ``memfd_create`` missing, too little memory).
        RendezvousError: another live process serves the same engine and rank.
    """

    def __init__(
        self, engine_id: str, rank: int, nbytes: int, header: dict[str, Any], *, pin: bool
    ) -> None:
        self._header = json.dumps(header).encode()
        if len(self._header) > _HEADER_MAX:
            raise ConfigError("the slot description is larger than 1 MiB")
        try:
            self._fd = os.memfd_create("kvtier-slots", os.MFD_CLOEXEC)
        except (AttributeError, OSError) as exc:
            raise ConfigError(f"cpu_bytes: cannot create shared slot memory: {exc}") from exc
        try:
            os.ftruncate(self._fd, nbytes)
            self.region = HostRegion(nbytes, pin=pin, fd=self._fd)
            self.region.prefault()
        except (OSError, ValueError) as exc:
            os.close(self._fd)
            raise ConfigError(f"cpu_bytes: cannot map {nbytes} bytes of slots: {exc}") from exc
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(socket_name(engine_id, rank))
        except OSError as exc:
            self._sock.close()
            self.region.close()
            os.close(self._fd)
            raise RendezvousError(
                f"another process already serves the kvtier slots of engine {engine_id!r} "
                f"rank {rank}: {exc}"
            ) from exc
        self._sock.listen(8)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kvtier-slots", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    if _peer_uid(conn) != os.getuid():
                        log.warning("kvtier: refused the slot memory to a process of another user")
                        continue
                    socket.send_fds(
                        conn, [struct.pack("<I", len(self._header)) + self._header], [self._fd]
                    )
                except OSError as exc:
                    log.warning("kvtier: handing over the slot memory failed: %s", exc)

    def close(self) -> None:
        """Stop serving and unmap (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)
        self.region.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


def attach(engine_id: str, rank: int, timeout_s: float) -> tuple[dict[str, Any], HostRegion]:
    """Scheduler side: receive the worker's slot memory and map it (blocks up to ``timeout_s``).

    Returns:
        ``(header, region)``: the worker's description of the slots and the
        shared, unpinned mapping of them.

    Raises:
        RendezvousError: no worker served the memory within ``timeout_s``
            seconds, or it sent something malformed.
    """
    deadline = time.monotonic() + timeout_s
    name = socket_name(engine_id, rank)
    last: BaseException | None = None
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            sock.connect(name)
            msg, fds, _, _ = socket.recv_fds(sock, _HEADER_MAX + 4, 1)
            want = 4 + struct.unpack("<I", msg[:4])[0] if len(msg) >= 4 else 4
            while len(msg) < want:  # a stream may deliver the header in pieces
                more = sock.recv(want - len(msg))
                if not more:
                    break
                msg += more
            break
        except OSError as exc:
            last = exc
        finally:
            sock.close()
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"the model worker of engine {engine_id!r} rank {rank} did not hand over the "
                f"kvtier slot memory within {timeout_s:g} s (raise rendezvous_timeout_s?): {last}"
            )
        time.sleep(0.05)
    if len(fds) != 1 or len(msg) < 4:
        for fd in fds:
            os.close(fd)
        raise RendezvousError("the model worker sent a malformed slot description")
    fd = fds[0]
    try:
        (n,) = struct.unpack("<I", msg[:4])
        header: dict[str, Any] = json.loads(msg[4 : 4 + n])
        region = HostRegion(int(header["num_slots"]) * int(header["slot_nbytes"]), pin=False, fd=fd)
    except (ValueError, KeyError, OSError) as exc:
        raise RendezvousError(f"the model worker sent a malformed slot description: {exc}") from exc
    finally:
        os.close(fd)  # the mapping keeps the memory
    return header, region
