"""What a tuning result depends on besides its config: versions, kernel sources, dtypes.

The source hash of an implementation covers the module that defines its kernel and, transitively,
every flashkern.kernels module it uses (problem layout, the DSL's shared helpers, the codecs), so
editing any of them makes earlier results stale. Three kinds of module are not kernel code and are not
followed: the test-case strategies (`cases` modules); the instruments that build, count and profile kernels
for the model and the build checks, and lint or replay what the GPU built (`INSTRUMENTS`), which change no kernel's output or speed; and the
families that the root package `flashkern.kernels` holds as attributes once imported (it imports none
itself), so editing one family leaves another's results current. The reference is hashed from its own
module.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import sys
import types

import torch

import flashkern

_KERNELS = "flashkern.kernels"


@functools.cache
def library_versions() -> dict[str, str]:
    """The versions a result depends on; Triton's and TileLang's from their installed metadata (the same strings
    as their __version__), so that reading a store does not import them."""
    from importlib.metadata import version

    from flashkern.autotune.timing import METHOD

    return {"torch": torch.__version__, "triton": version("triton"), "tilelang": version("tilelang"),
            "flashkern": flashkern.__version__, "timing": METHOD}


INSTRUMENTS = frozenset(f"{_KERNELS}.{name}" for name in ("build", "sass", "gpu_lint", "ttgir", "_triton.traffic",
                                                          "_tilelang.traffic", "_triton.pairing"))


def _is_kernel_code(module_name: str) -> bool:
    return (module_name.startswith(_KERNELS) and module_name.rpartition(".")[2] != "cases"
            and module_name not in INSTRUMENTS)


def _module_closure(name: str) -> list[str]:
    """`name` and every flashkern.kernels module of kernel code it reaches through its globals."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in sys.modules:
            continue
        seen.add(current)
        for value in vars(sys.modules[current]).values():
            owner = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            if isinstance(owner, str) and _is_kernel_code(owner):
                todo.append(owner)
    return sorted(seen)


@functools.cache
def source_hash(module_name: str) -> str:
    digest = hashlib.sha256()
    for name in _module_closure(module_name):
        digest.update(name.encode())
        digest.update(inspect.getsource(sys.modules[name]).encode())
    return digest.hexdigest()[:16]


def _entry_module(op, impl_name: str) -> str:
    if impl_name == "reference":
        return op.reference.__module__
    kernel = op.implementation(impl_name).kernel
    return (getattr(kernel, "plan", None) or kernel.program).__module__


def versions(op, impl_name: str) -> str:
    """Canonical JSON of the library versions and the source hash of one implementation (or the reference)."""
    return json.dumps({**library_versions(), "source": source_hash(_entry_module(op, impl_name))}, sort_keys=True)


def source_versions(op) -> dict[str, str]:
    """Per backend of `op`, the hash of its source (the reference's or the kernel module's)."""
    return {name: source_hash(_entry_module(op, name)) for name in op.backends}


def op_versions(op) -> str:
    """The versions of every candidate of `op`: a decision is current only while all of them are."""
    return json.dumps({**library_versions(), "sources": source_versions(op)}, sort_keys=True)


def dtypes(inputs: dict) -> str:
    """The dtypes of the tensor inputs, by argument name."""
    return ",".join(f"{k}={str(v.dtype).replace('torch.', '')}" for k, v in inputs.items() if isinstance(v, torch.Tensor))
