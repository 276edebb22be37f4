"""The GPU's element pairing replayed in Triton's interpreter: what each tl.histogram's operands hold on sm_90a.

A reshape that only feeds reductions may reorder elements on the GPU (kernels.ttgir.Reorder: each thread's
registers reused in order); where a histogram's values and mask reach it through reshapes of different layouts,
one element's bin meets another's mask (kernels.gpu_lint.reorder_pairing). The interpreter keeps every reshape in
order, so it cannot fail that way. Here a launch's TTGIR (built for sm_90a in a process that compiles: ttgir_of)
gives each histogram's operand permutations, and `gpu_pairing` runs the interpreter with them applied, each
histogram matched to its TTGIR op by source location (file and line, inlined calls included). Outcomes then follow
what the compiled kernel computes: the first H200 run's wrong top-k rows are reproduced this way
(tests/test_gpu_pairing.py).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import numpy as np

from flashkern.kernels import ttgir


@dataclass(frozen=True)
class Pairing:
    """One TTGIR histogram: where it is (innermost call first) and, per operand (values, mask), the permutation
    perm[i] = the logical element the GPU's element i holds, or None where the operand keeps its order."""

    sites: tuple[tuple[str, int], ...]
    operands: tuple[np.ndarray | None, ...]

    @property
    def reorders(self) -> bool:
        return any(p is not None for p in self.operands)


def pairings(text: str) -> list[Pairing]:
    """Every histogram of one kernel's TTGIR with its operands' element orders."""
    module = ttgir.Module(text)
    found = []
    for op in module.ops:
        if op.name != "tt.histogram":
            continue
        perms = []
        for operand in op.operands:
            orders = module.orders(operand)
            reorders = [o for o in orders if isinstance(o, ttgir.Reorder)]
            if len(orders) > 1 and reorders:
                raise NotImplementedError(f"{module.describe(op)}: an operand mixing element orders {orders}")
            perms.append(module.reorder_permutation(reorders[0]) if reorders else None)
        found.append(Pairing(module.where(op), tuple(perms)))
    return found


def _stack_sites(files: set) -> tuple[tuple[str, int], ...]:
    """(file, line) of the interpreter's frames in the kernels' source files, innermost first."""
    sites, frame = [], sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in files:
            sites.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return tuple(sites)


@contextlib.contextmanager
def gpu_pairing(found: list[Pairing]):
    """Inside, the interpreter's histograms pair their operands as `found` (from the launch's TTGIR) says the GPU
    does. A histogram the TTGIR does not hold is an error (the build and the run must be of one kernel)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    original = builder.create_histogram
    files = {file for pairing in found for file, _ in pairing.sites}

    def create_histogram(data, bins, mask):
        sites = _stack_sites(files)
        matching = [p for p in found if p.sites == sites[:len(p.sites)]]
        if not matching:
            raise LookupError(f"no histogram of the TTGIR at {sites} (the TTGIR's: {[p.sites for p in found]}): "
                              "build and run differ")
        perms = matching[0].operands
        if perms[0] is not None:
            data = interpreter.TensorHandle(data.data[perms[0]], data.dtype)
        if mask is not None and len(perms) > 1 and perms[1] is not None:
            mask = interpreter.TensorHandle(mask.data[perms[1]], mask.dtype)
        return original(data, bins, mask)

    builder.create_histogram = create_histogram  # the instance's, for this block only
    try:
        yield
    finally:
        del builder.create_histogram


def _described(launch) -> tuple:
    """What a worker needs to build `launch` as the JIT would: the kernel's module and name, its specialized
    signature and the launch options."""
    from flashkern.kernels._triton import _launch_options, _signature

    fn = launch.kernel.fn
    return (fn.__module__, fn.__name__, *_signature(launch), _launch_options(launch))


def _build_ttgir(described: tuple) -> str:
    module, name, signature, constexprs, attrs, options = described
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(module), name)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options).asm["ttgir"]


def serve() -> None:
    """The builder process: (setup, described launches) pickled on stdin -> their TTGIR texts pickled on stdout."""
    setup, described = pickle.load(sys.stdin.buffer)
    if setup is not None:
        setup()
    texts = [_build_ttgir(d) for d in described]
    sys.stdout.buffer.write(pickle.dumps(texts))


BUILDER_ENV = "FLASHKERN_TRITON_BUILDER"  # a Python whose Triton builds the TTGIR (default: this one)


def ttgir_of(launches, setup=None, python: str | None = None) -> list[str]:
    """The sm_90a TTGIR of each launch, as the Triton of `python` (default $FLASHKERN_TRITON_BUILDER, else this
    interpreter; another venv's, to replay another Triton version's build) compiles it, in a process with
    TRITON_INTERPRET=0, after `setup()` (a module-level function, or None) ran there."""
    python = python or os.environ.get(BUILDER_ENV) or sys.executable
    described = [_described(launch) for launch in launches]
    keys = [(python, setup, repr(d)) for d in described]
    missing = {key: d for key, d in zip(keys, described) if key not in _BUILT}
    if missing:
        _BUILT.update(zip(missing, _build_in(python, setup, list(missing.values()))))
    return [_BUILT[key] for key in keys]


_BUILT: dict = {}  # (builder, setup, described launch) -> TTGIR, for this process


def _build_in(python: str, setup, described: list) -> list[str]:
    payload = pickle.dumps((setup, described))
    own = [p for p in sys.path if p and not p.startswith(sys.base_prefix) and "-packages" not in p]  # not installs
    # A cache of its own: Triton's cache key is the source, not its path, so a shared cache can hand back the TTGIR
    # of another checkout, whose locations name files this run never executes.
    with tempfile.TemporaryDirectory(prefix="flashkern-ttgir-") as cache:
        env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(own), "TRITON_CACHE_DIR": cache}
        built = subprocess.run([python, "-c", "from flashkern.kernels._triton.pairing import serve; serve()"],
                               input=payload, capture_output=True, env=env)
    if built.returncode != 0:
        raise RuntimeError(f"building the TTGIR with {python} failed:\n" + built.stderr.decode()[-4000:])
    return pickle.loads(built.stdout)


def run_as_built(launches, setup=None) -> list[str]:
    """Run `launches` in order under the interpreter, each with its histograms paired as its sm_90a build pairs
    them (ttgir_of's build, after `setup`); returns each launch's TTGIR."""
    texts = ttgir_of(launches, setup)
    for launch, text in zip(launches, texts):
        if all(n > 0 for n in launch.grid):
            with gpu_pairing(pairings(text)):
                launch()
    return texts
