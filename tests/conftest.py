"""Shared test configuration: every async test runs on asyncio AND uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Parametrize every async test over the stdlib loop and uvloop."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests without CUDA and ``slow`` tests unless ``-m slow`` selects them."""
    import torch

    markexpr = config.getoption("markexpr") or ""
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "slow" in item.keywords and "slow" not in markexpr:
            item.add_marker(pytest.mark.skip(reason="slow: run with -m slow"))
