"""The usage examples of the README and the docs run as written (NVMe roots in a temp dir)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _first_python_block(page: Path) -> str:
    text = page.read_text()
    start = text.index("```python\n") + len("```python\n")
    return text[start : text.index("```", start)]


def _run_twice(code: str, root: str, tmp_path: Path) -> list[subprocess.CompletedProcess[str]]:
    assert f'root="{root}"' in code
    code = code.replace(f'root="{root}"', f"root={str(tmp_path)!r}")
    return [
        subprocess.run(
            [sys.executable, "-P", "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=tmp_path,
        )
        for _ in range(2)  # a second run (a restart) finds the keys on NVMe
    ]


def test_readme_python_example_runs(tmp_path: Path) -> None:
    runs = _run_twice(_first_python_block(REPO / "README.md"), "/tmp/kvtier-nvme", tmp_path)
    for res in runs:
        assert res.returncode == 0, res.stderr[-2000:]
        assert "EngineStats(" in res.stdout
    assert "[<Residency.CPU: 'cpu'>]" in runs[0].stdout
    assert "[<Residency.NVME: 'nvme'>]" in runs[1].stdout


def test_serving_example_resumes_a_hybrid_request_from_nvme(tmp_path: Path) -> None:
    page = REPO / "docs" / "serving.md"
    runs = _run_twice(_first_python_block(page), "/tmp/kvtier-serving", tmp_path)
    printed = "resume at chunk 6: promoted 8, loaded 8, failed 0, CPU hits 8"
    for res in runs:
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.strip() == printed
    assert f"It prints `{printed}`" in page.read_text()
