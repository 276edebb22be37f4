"""Per-shape comparison of backends from the store: best time per backend, speedup over the
reference, the fraction of the memory roofline (bytes moved / time / peak bandwidth) where
the device's bandwidth is known, the decision, and candidates that failed; plus a PNG plot.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashkern.autotune import identity
from flashkern.autotune import store as st


@dataclass(frozen=True)
class ShapeRow:
    shape: str
    spec: str
    sizes: tuple[int, ...]
    bytes: float
    best: dict  # backend -> the fastest OK result of that backend
    failed: list  # results that did not pass (incorrect, build failures, pruned, errors)
    decision: st.Decision | None


def rows(store: st.Store, op, device_key: str) -> list[ShapeRow]:
    """One row per shape with current results, ordered by specialization then sizes."""
    current = {name: identity.versions(op, name) for name in op.backends}
    decisions = {d.shape: d for d in store.decisions(op.name, device_key) if d.versions == identity.op_versions(op)}
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


def plot(shape_rows: list[ShapeRow], backends, title: str, path: str) -> None:
    """Time per backend per shape (log scale) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(shape_rows) + 2), 4.5))
    for backend, marker in zip(backends, "os^vD"):
        xs = [i for i, row in enumerate(shape_rows) if backend in row.best]
        ax.plot(xs, [shape_rows[i].best[backend].median * 1e6 for i in xs], marker=marker, label=backend)
    ax.set_yscale("log")
    ax.set_ylabel("time per call (µs, best config)")
    ax.set_xticks(range(len(shape_rows)))
    ax.set_xticklabels([row.shape.replace(" ", "\n", 3) for row in shape_rows], fontsize=7)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
