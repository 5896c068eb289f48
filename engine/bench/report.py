"""The figures of a run as a rich table, a JSON file and a PNG bar chart."""

from __future__ import annotations

import json
from typing import Any

from rich.markup import escape


def _ms(value: float | None) -> str:
    """A latency cell: milliseconds with three decimals, empty when not measured."""
    return "" if value is None else f"{value:.3f}"


def _size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it at 1 or more (``"256 MiB"``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.4g} {unit}"
    return f"{nbytes} bytes"


def format_table(result: dict[str, Any]) -> Any:
    """A rich Table of the phases."""
    from rich.table import Table

    lay, cfg = result["layout"], result["config"]
    moved = result["phases"]["store"]["bytes"]
    groups = f"{lay['groups']} group{'s' if lay['groups'] != 1 else ''}"
    caption = (
        f"{moved / 2**20:.0f} MiB per phase, {lay['chunks']} chunks x "
        f"{cfg['blocks_per_chunk']} blocks, {groups}, "
        f"{cfg['repeat']} repeat{'s' if cfg['repeat'] != 1 else ' (single samples: noisy)'}"
    )
    if moved > cfg["size_bytes"]:  # the data set holds at least one chunk per group
        caption += f"; above --size {_size(cfg['size_bytes'])}: one chunk per group"
    table = Table(
        title=f"kvtier bench - {escape(result['layout']['name'])} ({result['machine']['device']})",
        caption=caption,
    )
    for col in ("phase", "GB/s", "p50 ms", "p99 ms", "baseline GB/s", "ratio"):
        table.add_column(col, justify="right" if col != "phase" else "left")
    for name, p in result["phases"].items():
        bases = [k.removesuffix("_gbps") for k in p if k.endswith("_gbps") and k != "gbps"]
        first = True
        for b in bases or [None]:
            table.add_row(
                name if first else "",
                f"{p['gbps']:.2f}" if first else "",
                _ms(p.get("p50_ms")) if first else "",
                _ms(p.get("p99_ms")) if first else "",
                f"{b}: {p[f'{b}_gbps']:.2f}" if b else "",
                f"{p[f'ratio_vs_{b}']:.2f}x" if b and p.get(f"ratio_vs_{b}") else "",
            )
            first = False
        for variant, v in p.items():  # kvtier run another way: ratio to the first baseline
            if isinstance(v, dict) and "gbps" in v:
                b = bases[0] if bases else None
                ratio = v.get(f"ratio_vs_{b}") if b else None
                table.add_row(
                    f"  {variant}",
                    f"{v['gbps']:.2f}",
                    "",
                    "",
                    f"{b}: {p[f'{b}_gbps']:.2f}" if b else "",
                    f"{ratio:.2f}x" if ratio else "",
                )
    return table


def plot(result: dict[str, Any], path: str) -> None:
    """Write a PNG bar chart of GB/s per phase against the baselines (needs matplotlib).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = result["phases"]
    names = list(phases)
    series: dict[str, list[float]] = {"kvtier": [phases[n]["gbps"] for n in names]}
    for n in names:
        for k, v in phases[n].items():
            if k.endswith("_gbps") and k != "gbps":
                series.setdefault(k.removesuffix("_gbps"), [0.0] * len(names))[names.index(n)] = v
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for i, (label, vals) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(names))], vals, width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=20, ha="right")
    ax.set_ylabel("GB/s")
    ax.set_title(f"kvtier bench: {result['layout']['name']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def to_json(result: dict[str, Any], path: str) -> None:
    """Write the figures as JSON."""
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
