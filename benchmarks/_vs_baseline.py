"""Reporting shared by the benchmarks that time this checkout (\"this\") against a baseline commit."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional


def print_table(
    med: dict[str, dict[str, float]],
    cases: list[str],
    baseline: Optional[str],
    case_width: int,
    digits: int,
    extra: Callable[[str], str] = lambda case: "",
) -> None:
    """Per case this checkout's value, and the baseline's with baseline / this when there is one;
    `extra(case)` ends each line."""
    num = max(8, digits + 6)
    head = f"{'case':{case_width}s} {'this':>{num}s}" + (f" {baseline:>12s} {'ratio':>7s}" if baseline else "")
    print(head)
    print("-" * len(head))
    for c in cases:
        line = f"{c:{case_width}s} {med['this'][c]:{num}.{digits}f}"
        if baseline:
            line += f" {med[baseline][c]:12.{digits}f} {med[baseline][c] / med['this'][c]:6.2f}x"
        print(line + extra(c))


def grouped_bars(
    path: Path,
    values: dict[str, dict[str, float]],
    cases: list[str],
    ylabel: str,
    title: str,
    figsize: tuple[float, float] = (6, 3.5),
) -> None:
    """One group of bars per case, one bar per series (`values[series][case]`; the series
    "this" is labelled "this checkout"); writes `path` and says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / len(values)
    for i, (name, per_case) in enumerate(values.items()):
        ax.bar(
            [j + i * width for j in range(len(cases))],
            [per_case[c] for c in cases],
            width,
            label="this checkout" if name == "this" else name,
        )
    ax.set_xticks([j + width * (len(values) - 1) / 2 for j in range(len(cases))], cases)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
