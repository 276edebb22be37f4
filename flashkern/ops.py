"""Public entry points, one per registered operator: `flashkern.ops.<name>(...)`.

Each takes backend="reference" | "triton" | "tilelang" | "auto", config= (an explicit
tuning config; see flashkern.dispatch for the rule "auto" follows) and out= (preallocated
outputs shaped as the result: a tensor, or a tuple of them; contiguous, on the inputs' device,
sharing no memory with an input; written in full and returned). Under torch.compile each
emits its custom op, torch.ops.flashkern.<name> (flashkern.library).
"""

from flashkern import registry


def __getattr__(name: str):
    ops = registry.operators()
    if name in ops:
        return ops[name].entry
    raise AttributeError(f"flashkern.ops has no operator {name!r}; known: {', '.join(sorted(ops))}")


def __dir__():
    return sorted(registry.operators())
