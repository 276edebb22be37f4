"""Per-shape comparison of backends from the store: best time per backend, speedup over the
reference, the fraction of the memory roofline (bytes moved / time / peak bandwidth) where
the device's bandwidth is known, the decision, and candidates that failed; plus a PNG plot.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashkern.autotune import identity
from flashkern.autotune import store as st
from flashkern.autotune import table as tables


@dataclass(frozen=True)
class ShapeRow:
    shape: str
    spec: str
    sizes: tuple[int, ...]
    bytes: float
    best: dict  # backend -> the fastest OK result of that backend
    failed: list  # results that did not pass (incorrect, build failures, pruned, errors)
    decision: st.Decision | None


def _current_versions(op) -> dict[str, str]:
    return {name: identity.versions(op, name) for name in op.backends}


def stale_count(store: st.Store, op, device_key: str) -> int:
    """Results for this device measured with other versions (kept, not shown or used)."""
    current = _current_versions(op)
    return sum(current.get(r.key.impl) != r.key.versions for r in store.results(op.name, device_key))


def rows(store: st.Store, op, device_key: str) -> list[ShapeRow]:
    """One row per shape with current results, ordered by specialization then sizes."""
    current = _current_versions(op)
    decisions = {d.shape: d for d in tables.current_decisions(store, device_key, op.name)}
    shapes: dict[str, list[st.Result]] = {}
    for r in store.results(op.name, device_key):
        if current.get(r.key.impl) == r.key.versions:
            shapes.setdefault(r.key.shape, []).append(r)
    out = []
    for shape, results in shapes.items():
        best = {}
        for r in results:
            if r.status == st.OK and (r.key.impl not in best or r.median < best[r.key.impl].median):
                best[r.key.impl] = r
        failed = [r for r in results if r.status not in (st.OK, st.CHECKED)]
        first = results[0]
        out.append(ShapeRow(shape, first.spec, first.sizes, first.bytes, best, failed, decisions.get(shape)))
    return sorted(out, key=lambda row: (row.spec, row.sizes))


def _common_words(shapes: list[str]) -> str:
    words = shapes[0].split()
    return " ".join(w for w in words if all(w in s.split() for s in shapes))


def plot(shape_rows: list[ShapeRow], backends, title: str, path: str, modelled: dict | None = None) -> None:
    """Time per backend against size, one panel per specialization (log-log), as a PNG; dashed, the performance
    model's predicted H200 time per kernel (`modelled`: backend -> shape key -> seconds) at the shapes it covers."""
    from matplotlib import ticker
    from matplotlib.figure import Figure  # no pyplot: no GUI backend chosen, nothing global changed

    groups: dict[str, list[ShapeRow]] = {}
    for row in shape_rows:
        groups.setdefault(row.spec, []).append(row)
    fig = Figure(figsize=(5.5 * len(groups), 4.2))
    axes = fig.subplots(1, len(groups), squeeze=False)
    for ax, rows_ in zip(axes[0], groups.values()):
        shared = _common_words([r.shape for r in rows_])
        for backend, marker in zip(backends, "os^vD"):
            points = [(r.sizes[0], r.best[backend].median * 1e6) for r in rows_ if backend in r.best]
            if points:
                ax.plot(*zip(*points), marker=marker, label=backend)
            predicted = [(r.sizes[0], (modelled or {}).get(backend, {})[r.shape] * 1e6) for r in rows_
                         if r.shape in (modelled or {}).get(backend, {})]
            if predicted:
                ax.plot(*zip(*predicted), linestyle="--", marker=marker, fillstyle="none",
                        label=f"{backend}, H200 model")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        for axis, base in ((ax.xaxis, 2), (ax.yaxis, 10)):  # plain tick labels: mathtext's are most of the plot's time
            axis.set_major_formatter(ticker.LogFormatter(base=base, labelOnlyBase=False))
            axis.set_minor_formatter(ticker.LogFormatter(base=base, labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        ax.set_xlabel(" ".join(w for w in rows_[0].shape.split() if w not in shared.split()).split("=")[0] or "size")
        ax.set_ylabel("µs per call (best config)")
        ax.set_title(shared, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.subplots_adjust(left=0.12 / len(groups) + 0.02, right=0.98, bottom=0.13, top=0.84, wspace=0.28)  # fixed: a
    # tight layout measures every label first (a sixth of the plot's time)
    fig.savefig(path, dpi=120)
