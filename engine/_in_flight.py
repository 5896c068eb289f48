"""Keys in flight: what a load or a prefetch waits for before it reads its keys.

A key whose store (its GPU -> CPU copy) or promotion (its NVMe row read into
a slot) is in flight has a future in the engine's ``ready`` map until that
ends. A call on such keys waits for them first, again when another call
started one meanwhile (else the key would read as a miss), at most
:data:`MAX_WAIT_ROUNDS` times. :class:`CallContext` is how the caller that
awaits the call's task tells it that it is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier._types import OffloadKey
from kvtier.errors import KeyNotResidentError

MAX_WAIT_ROUNDS = 8
"""How many times a call waits for operations in flight on its keys."""


@dataclass
class CallContext:
    """Set by the awaiting caller when it is cancelled.

    ``woken`` (made by the caller) is set then too, so that a wait for
    another call's turn ends at once.

    Attributes:
        cancelled: the caller is gone: the call copies or reads nothing more.
        woken: a future set when the caller is cancelled (None if unused).
    """

    cancelled: bool = False
    woken: asyncio.Future[None] | None = None

    def cancel(self) -> None:
        """The caller is gone: copy nothing more."""
        self.cancelled = True
        if self.woken is not None and not self.woken.done():
            self.woken.set_result(None)


async def wait_in_flight(
    ready: dict[OffloadKey, asyncio.Future[bool]], keys: Iterable[OffloadKey], ctx: CallContext
) -> None:
    """Wait until no store or promotion of ``keys`` is in flight, or the caller is gone.

    Cancelling the waiting task does not cancel the operations it waits for.

    Args:
        ready: the engine's futures of keys in flight.
        keys: the call's keys.
        ctx: the call's context; a cancelled caller stops the wait.
    """
    keys = list(keys)
    for _ in range(MAX_WAIT_ROUNDS):
        waits = {ready[k] for k in keys if k in ready}
        if not waits or ctx.cancelled:
            break
        await asyncio.wait(waits)  # not gather: cancelling us must not cancel them


def on_no_medium(key: OffloadKey) -> KeyNotResidentError:
    """The error of a key that is neither in a CPU slot, nor in flight, nor on NVMe.

    Args:
        key: the missing key.

    Returns:
        The :class:`KeyNotResidentError` a load or prefetch reports for it.
    """
    return KeyNotResidentError(f"{key} is on no medium (evicted or never stored)")
