"""Plot a sweep: external tokens and E against prompt length, mismatches marked.

Uses matplotlib (the ``plot`` extra), imported lazily; headless (Agg backend).
"""

from __future__ import annotations

from collections.abc import Sequence

from keytrace.analysis.sweep import SweepRow
from keytrace.errors import KeytraceError, install_hint


def plot_sweep(
    rows: Sequence[SweepRow],
    paths: Sequence[str],
    *,
    title: str = "",
    fixed: tuple[str, Sequence[SweepRow]] | None = None,
) -> list[str]:
    """Write the plot to every path (format from the suffix, e.g. .png and .svg).
    ``fixed``: (fix name, the same lengths swept with that candidate fix), drawn over it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise KeytraceError(f"plotting needs matplotlib ({exc}); {install_hint('plot')}") from exc
    xs = [r.length for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    ax.plot(
        xs,
        [r.E if r.E is not None else float("nan") for r in rows],
        color="#999999",
        lw=1.2,
        label="expected boundary E",
        drawstyle="steps-post",
    )
    ax.plot(
        xs,
        [r.external for r in rows],
        color="#1f77b4",
        lw=1.0,
        marker=".",
        ms=3,
        ls="none",
        label="external tokens (real vLLM scheduler)",
    )
    bad = [r for r in rows if r.verdict == "mismatch"]
    if bad:
        ax.scatter(
            [r.length for r in bad],
            [r.external for r in bad],
            color="#d62728",
            marker="x",
            s=28,
            zorder=3,
            label=f"mismatch ({len(bad)} of {len(rows)})",
        )
    if fixed is not None:
        name, frows = fixed
        ax.scatter(
            [r.length for r in frows],
            [r.external for r in frows],
            facecolors="none",
            edgecolors="#2ca02c",
            marker="o",
            s=22,
            zorder=2,
            label=f"external tokens with fix {name}",
        )
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("tokens")
    ax.set_title(title or "keytrace sweep")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", fontsize=8)  # hits sit at E, misses at 0: the middle is free
    fig.tight_layout()
    for p in paths:
        fig.savefig(p)
    plt.close(fig)
    return list(paths)
