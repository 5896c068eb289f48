"""mkdocs hook: lay the package out as one folder for the API reference.

The import package ``kvtier`` lives in ``engine/`` and ``kvtier.io`` in ``io/``
(``setup.cfg``'s ``package_dir``). mkdocstrings reads the source statically
(griffe), which finds a package by its folder name, so this hook copies both
folders' modules into a temporary ``kvtier/`` (with ``kvtier/io/``) and puts
that folder first on the Python handler's search paths. It runs before
mkdocstrings reads its configuration; nothing in the repository changes.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[2]


@event_priority(100)
def on_config(config: Any) -> Any:
    """Copy ``engine/`` and ``io/`` into ``<tmp>/kvtier`` and search there first."""
    stage = Path(tempfile.mkdtemp(prefix="kvtier-api-"))
    atexit.register(shutil.rmtree, stage, ignore_errors=True)
    package = stage / "kvtier"
    for source, target in ((ROOT / "engine", package), (ROOT / "io", package / "io")):
        target.mkdir(parents=True)
        for module in source.glob("*.py"):
            shutil.copy2(module, target / module.name)
    handlers = config.plugins["mkdocstrings"].config.handlers
    python = handlers.setdefault("python", {})
    python["paths"] = [str(stage), *python.get("paths", [])]
    return config
