"""The README's usage example runs as written, twice (with its NVMe root moved to a temp dir)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_readme_python_example_runs(tmp_path: Path) -> None:
    text = (REPO / "README.md").read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start : text.index("```", start)]
    assert 'root="/tmp/kvtier-nvme"' in code
    code = code.replace('root="/tmp/kvtier-nvme"', f"root={str(tmp_path)!r}")
    runs = [
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
        )
        for _ in range(2)  # a second run (a restart) finds the key on NVMe
    ]
    for res in runs:
        assert res.returncode == 0, res.stderr[-2000:]
        assert "EngineStats(" in res.stdout
    assert "[<Residency.CPU: 'cpu'>]" in runs[0].stdout
    assert "[<Residency.NVME: 'nvme'>]" in runs[1].stdout
