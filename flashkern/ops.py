"""Public entry points, one per registered operator: `flashkern.ops.<name>(...)`.

Each takes backend="reference" | "triton" | "tilelang" | "auto" and config= (an explicit
tuning config); see flashkern.dispatch for the rule "auto" follows.
"""

from flashkern import registry


def __getattr__(name: str):
    ops = registry.operators()
    if name in ops:
        return ops[name].entry
    raise AttributeError(f"flashkern.ops has no operator {name!r}; known: {', '.join(sorted(ops))}")


def __dir__():
    return sorted(registry.operators())
