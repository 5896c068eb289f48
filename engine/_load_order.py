"""Load ordering: later load calls into the same GPU pages submit after earlier ones.

A load call that must wait before it submits its copies (a store or promotion
in flight on one of its keys) takes a :class:`LoadTurn`; a later call that
writes any of its GPU pages waits for that turn, so that copies reach the copy
executor in call order and the later call's bytes are the ones left.
:class:`LoadOrder` is the queue of waiting turns: pure state, no I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier._types import Chunk


@dataclass(eq=False)
class LoadTurn:
    """A load call that waits before it submits its copies (a store in flight, a promotion).

    Later load calls that write any of its GPU pages wait for ``submitted``
    before they submit theirs, so that jobs reach the copy executor in call
    order and the later call's bytes are the ones left (:meth:`kvtier.TransferEngine.load`).

    Attributes:
        pages: ``{label: block ids}`` the call writes; a label names the
            groups whose blocks share bytes only at the same block id
            (:func:`kvtier._aliasing.aliasing_labels`).
        classes: alias classes of the call's groups whose blocks may share
            bytes at other block ids (every block of such a class counts).
        submitted: set once the call's copies were submitted, or once it
            ended without submitting any.
    """

    pages: dict[int, set[int]]
    classes: set[int]
    submitted: asyncio.Future[None]

    def overlaps(self, pages: dict[int, set[int]], classes: set[int]) -> bool:
        """Whether a call writing ``pages`` and ``classes`` may write bytes this one writes."""
        if not self.classes.isdisjoint(classes):
            return True
        mine = self.pages
        return any(g in mine and not mine[g].isdisjoint(ids) for g, ids in pages.items())


class LoadOrder:
    """The load calls that wait before they submit, in call order.

    Args:
        page_label: group id -> label of the groups whose blocks share bytes
            only at the same block id (their pages compare by block id), or
            None for a group whose blocks may meet other block ids of its
            alias class (every block counts).
        alias_class: group id -> its alias class
            (:func:`kvtier._validation.alias_classes`).

    Attributes:
        turns: the turns not yet ended, oldest first.
    """

    def __init__(self, page_label: dict[int, int | None], alias_class: dict[int, int]) -> None:
        self._page_label = page_label
        self._alias_class = alias_class
        self.turns: list[LoadTurn] = []

    def take(
        self, chunks: Sequence[Chunk], must_wait: bool
    ) -> tuple[LoadTurn, list[LoadTurn]] | None:
        """Queue a load call behind earlier waiting loads of its GPU pages, if it must wait.

        A call waits (and is registered as a :class:`LoadTurn`) when one of
        its keys has a store or promotion in flight or must be promoted, or
        when an earlier load call that writes one of its GPU pages is still
        waiting: its copies must reach the executor after that call's.

        Args:
            chunks: the call's chunks.
            must_wait: one of its keys has a store or promotion in flight or
                must be promoted.

        Returns:
            ``None`` when the call can submit at once, else its turn and the
            earlier turns it waits for.
        """
        if not must_wait and not self.turns:
            return None
        pages, classes = self.pages_of(chunks)
        ahead = [t for t in self.turns if t.overlaps(pages, classes)]
        if not ahead and not must_wait:
            return None
        turn = LoadTurn(pages, classes, asyncio.get_running_loop().create_future())
        self.turns.append(turn)
        return turn, ahead

    def pages_of(self, chunks: Sequence[Chunk]) -> tuple[dict[int, set[int]], set[int]]:
        """The GPU pages ``chunks`` write: ``({label: block ids}, alias classes)``."""
        pages: dict[int, set[int]] = {}
        classes: set[int] = set()
        for chunk in chunks:
            g = chunk.key.group_id
            label = self._page_label[g]
            if label is None:
                classes.add(self._alias_class[g])
            elif label in pages:
                pages[label].update(chunk.block_ids)
            else:
                pages[label] = set(chunk.block_ids)
        return pages, classes

    def end(self, turn: LoadTurn) -> None:
        """The call submitted its copies (or never will): later loads may submit theirs."""
        if not turn.submitted.done():
            self.turns.remove(turn)
            turn.submitted.set_result(None)
