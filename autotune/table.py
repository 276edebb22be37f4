"""Per-device dispatch tables: what backend="auto" runs for each shape, built once from the store.

A table holds, per (operator, specialization), the tuned winners by size bucket (each size
rounded up to a power of two). A lookup takes the exact bucket, else the nearest bucket (the
smallest sum of |log2| distances over the sizes), else nothing: the caller then uses its
default rule. Only decisions for this device and the current versions of every candidate are
loaded; stale ones stay in the store, unused. Tables export to and import from JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass

from flashkern.autotune import identity
from flashkern.autotune import store as st

FORMAT = "flashkern-table-1"


def bucket(sizes) -> tuple[int, ...]:
    """Each size rounded up to a power of two (0 stays 0)."""
    return tuple(0 if s <= 0 else 1 << (s - 1).bit_length() for s in sizes)


def _distance(a, b) -> float:
    return sum(abs(math.log2(max(x, 1)) - math.log2(max(y, 1))) for x, y in zip(a, b))


@dataclass(frozen=True)
class Entry:
    impl: str
    config: dict
    decision: st.Decision


class Table:
    def __init__(self, decisions: list[st.Decision] = ()):
        self._entries: dict[tuple[str, str], dict[tuple[int, ...], Entry]] = {}
        for d in sorted(decisions, key=lambda d: d.created):  # later decisions win a shared bucket
            by_bucket = self._entries.setdefault((d.op, d.spec), {})
            by_bucket[bucket(d.sizes)] = Entry(d.impl, json.loads(d.config), d)
        # the table never changes after construction: remember answers per (op, problem), one hash per call
        self.lookup = functools.lru_cache(maxsize=8192)(self._lookup)

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def _lookup(self, op_name: str, problem) -> Entry | None:
        """The tuned choice for `problem`: exact bucket, else nearest bucket, else None."""
        by_bucket = self._entries.get((op_name, repr(problem.specialization())))
        if not by_bucket:
            return None
        wanted = bucket(problem.sizes)
        hit = by_bucket.get(wanted)
        if hit is not None:
            return hit
        return by_bucket[min(by_bucket, key=lambda b: _distance(b, wanted))]


def current_decisions(store: st.Store, device_key: str, op_name: str | None = None) -> list[st.Decision]:
    """Decisions for this device whose competitors all have the versions running now."""
    from flashkern import registry

    wanted = {name: identity.op_versions(op) for name, op in registry.operators().items()}
    return [d for d in store.decisions(op_name, device_key) if wanted.get(d.op) == d.versions]


def from_store(store: st.Store, device_key: str) -> Table:
    return Table(current_decisions(store, device_key))


def export_json(decisions: list[st.Decision], device_key: str) -> str:
    return json.dumps({"format": FORMAT, "device": device_key,
                       "entries": [{**d.__dict__, "sizes": list(d.sizes)} for d in decisions]}, indent=1)


def import_json(store: st.Store, text: str) -> int:
    """Store the decisions of an exported table (they apply where device and versions match); returns how many."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"not a flashkern table (format {found!r}, expected {FORMAT!r})")
    fields = dataclasses.fields(st.Decision)
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    decisions = []
    for i, entry in enumerate(data.get("entries", [])):
        missing = [name for name in required if not isinstance(entry, dict) or name not in entry]
        if missing:
            raise ValueError(f"entry {i} lacks {', '.join(missing)} (written by another flashkern?); nothing imported")
        given = {f.name: entry[f.name] for f in fields if f.name in entry}
        decisions.append(st.Decision(**{**given, "sizes": tuple(entry["sizes"])}))
    for decision in decisions:
        store.decide(decision)
    return len(decisions)
