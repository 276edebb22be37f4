"""Backend selection and the checked call path shared by every operator entry point.

backend="reference" | "triton" | "tilelang" | "auto"; config= an explicit tuning config for
the chosen kernel (default: the implementation's default config for the problem).

backend="auto" runs, in this order:
  1. the tuned choice for the shape from this device's dispatch table (autotune.table: built
     once per process from the tuning store, current versions only; exact size bucket, else the
     nearest bucket of the same specialization);
  2. else the default rule: on CUDA the first implementation that can run here, Triton before
     TileLang, in its default config; on CPU the reference. Both kernel paths are correctness
     paths there: PyTorch's vectorized kernels beat TileLang's C and Triton's interpreter at
     most shapes (`flashkern bench`), and interpreted Triton is never chosen for speed;
  3. the reference when no implementation can run on the device.
The order of checks is: arguments (named in the error), backend name, device support, config;
nothing is launched before all of them pass. A tuned table's configs were checked when tuned.
`explain` says what auto runs for a problem and why (`flashkern explain OP`); FLASHKERN_LOG_DISPATCH=1
prints each choice to stderr once per (operator, problem, device).
The checks and the choice are made once per call signature (operator, backend, config, the values and
classes of the other arguments, and the class, dtype, device, sizes and strides of every tensor) and
cached (`CallSite`): a repeated call costs a dictionary lookup and one C++ guard check of its tensors,
2.0 to 3.3 us over the bare launch (median) on a 2-core CI machine (benchmarks/dispatch_overhead.py). Nothing
on this path reads tensor values (value checks run in checked mode only, flashkern.checks).
"""

from __future__ import annotations

import operator
import os
import sys
import warnings

import torch
from torch._C._dynamo.guards import TensorGuards

from flashkern import checks, library
from flashkern import device as devices
from flashkern.autotune import store as stores
from flashkern.autotune import table as tables
from flashkern.registry import Implementation, Operator, device_of

AUTO_ORDER = {"cuda": ("triton", "tilelang"), "cpu": ()}
_TABLES: dict[str, tables.Table] = {}  # device key -> dispatch table, built once per process


def rule_choice(op: Operator, device_info) -> Implementation | None:
    """The default rule for untuned shapes: the implementation to run, or None for the reference."""
    for name in AUTO_ORDER.get(device_info.kind, ()):
        impl = op.implementation(name)
        if impl.unavailable(device_info) is None:
            return impl
    return None


def table_for(device_info) -> tables.Table:
    """This device's dispatch table from the default store (empty if there is none or it is unreadable)."""
    table = _TABLES.get(device_info.key)
    if table is None:
        table = tables.Table()
        path = stores.default_path()
        if path.exists():
            try:
                with stores.Store(path) as store:
                    table = tables.from_store(store, device_info.key)
            except stores.StoreError as exc:
                warnings.warn(f"{exc} Until then backend='auto' uses its default rule.", RuntimeWarning, stacklevel=3)
        _TABLES[device_info.key] = table
    return table


def reload_tables() -> None:
    """Forget the loaded tables and the plans chosen from them (after tuning in this process, or to pick up
    another store)."""
    _TABLES.clear()
    _SITES.clear()


def explain(op: Operator, problem, device_info) -> tuple[str, dict | None, str]:
    """What backend="auto" runs for `problem` on the device, and why: (backend name, config or None, reason)."""
    entry = table_for(device_info).lookup(op.name, problem)
    if entry is not None:
        exact = tables.bucket(entry.decision.sizes) == tables.bucket(problem.sizes)
        why = "tuned: this size bucket" if exact else f"tuned: nearest size bucket (tuned at {entry.decision.sizes})"
        if entry.impl == "reference":
            return "reference", None, why
        reason = op.implementation(entry.impl).unavailable(device_info)
        if reason is None:
            return entry.impl, entry.config, why
        unusable = f"tuned {entry.impl} cannot run here ({reason}); "
    else:
        unusable = ""
    impl = rule_choice(op, device_info)
    if impl is not None:
        return impl.name, impl.default_config(problem), f"{unusable}default rule on {device_info.kind}: " \
            f"{' before '.join(AUTO_ORDER[device_info.kind])}, default config"
    why = "the reference beats the CPU kernel paths" if device_info.kind == "cpu" else "no kernel can run here"
    return "reference", None, f"{unusable}default rule on {device_info.kind}: {why}"


def auto_choice(op: Operator, problem, device_info) -> tuple[Implementation | None, dict | None]:
    """What backend="auto" runs for `problem`: (implementation, config), or (None, None) for the reference."""
    backend, config, _ = explain(op, problem, device_info)
    return (None, None) if backend == "reference" else (op.implementation(backend), config)


def resolve(op: Operator, problem, device_info, backend: str, config) -> tuple[Implementation | None, dict | None]:
    """(implementation or None for the reference, checked config) for one call."""
    if backend not in (*op.backends, "auto"):
        raise ValueError(f"backend must be one of {(*op.backends, 'auto')}, got {backend!r}")
    if backend == "auto":
        if config is not None:
            raise ValueError("config needs an explicit backend; backend='auto' picks its own config")
        return auto_choice(op, problem, device_info)
    if backend == "reference":
        impl = None
    else:
        impl = op.implementation(backend)
        reason = impl.unavailable(device_info)
        if reason is not None:
            raise RuntimeError(f"backend={backend!r} cannot run on {device_info.describe()}: {reason}")
    if impl is None:
        if config is not None:
            raise ValueError(f"config is for a kernel, but backend={backend!r} runs the reference")
        return None, None
    if config is None:
        config = impl.default_config(problem)
    impl.space.check(problem, config, device_info.kind)
    return impl, config


class Plan:
    """What one call signature runs: the checked problem, the implementation (None: the reference), its config,
    the device, op.prepare when it makes kernel views of these arguments (else None), and the expected outputs'
    metadata (on the meta device, once a call passes out=)."""

    __slots__ = ("problem", "impl", "config", "device", "prepare", "out_spec")

    def __init__(self, problem, impl, config, device, prepare):
        self.problem, self.impl, self.config, self.device = problem, impl, config, device
        self.prepare, self.out_spec = prepare, None


LOG_DECISIONS = os.environ.get("FLASHKERN_LOG_DISPATCH", "0") not in ("", "0")  # each choice to stderr, once
_LOGGED: set = set()  # (operator, problem, device) already logged
MAX_PLANS = 64  # call signatures kept per operator and non-tensor arguments (one per batch size in serving)


def _getter(names: tuple[str, ...]):
    """dict -> tuple of the values at `names` (operator.itemgetter, always returning a tuple)."""
    if len(names) == 1:
        return lambda values, name=names[0]: (values[name],)
    return operator.itemgetter(*names) if names else lambda values: ()


class CallSite:
    """One operator's plan cache. A call's arguments split by the entry's annotations: the tensors, matched by
    dynamo's C++ tensor guard (exact class, dispatch keys, dtype, device, requires_grad, sizes and strides: about
    0.1 us per tensor), and the rest, keyed by value and class (so True is not 1) with the backend, the config
    and which optional tensors are None. Plans under one key (one per batch size, say) are tried most recently
    used first."""

    def __init__(self, op: Operator):
        params = library.parameters(op.entry)
        required = tuple(p.name for p in params if p.type == "Tensor")
        self.tensor_names = required + tuple(p.name for p in params if p.type == "Tensor?")
        self.arguments = _getter(self.tensor_names + tuple(p.name for p in params if p.name not in self.tensor_names))
        self.required = len(required)
        self.plans: dict[tuple, tuple] = {}  # key -> (getter of the tensors given, [(TensorGuards, Plan)] MRU last)

    def find(self, inputs: dict, backend: str, config: dict | None) -> tuple[Plan | None, tuple | None]:
        """(cached plan or None, key or None when an argument is unhashable: the checks will name it)."""
        values = self.arguments(inputs)
        key = (backend, tuple(sorted(config.items())) if isinstance(config, dict) else config,  # not a dict: refused
               values[len(self.tensor_names):],
               tuple(map(type, values[self.required:])))  # classes: True is not 1; which optional tensors are None
        try:
            found = self.plans.get(key)
        except TypeError:
            return None, None
        if found is not None:
            given, plans = found
            tensors = given(inputs)
            if plans[-1][0].check(*tensors):
                return plans[-1][1], key
            for i in range(len(plans) - 2, -1, -1):
                if plans[i][0].check(*tensors):
                    plans.append(plans.pop(i))
                    return plans[-1][1], key
        return None, key

    def add(self, key: tuple, inputs: dict, made: Plan) -> None:
        if key not in self.plans:
            self.plans[key] = (_getter(tuple(n for n in self.tensor_names if inputs[n] is not None)), [])
        given, plans = self.plans[key]
        tensors = given(inputs)
        guards = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                              dynamic_dims_strides=[list(t.stride()) for t in tensors])
        if len(plans) >= MAX_PLANS:
            del plans[0]
        plans.append((guards, made))


_SITES: dict[str, CallSite] = {}  # operator name -> its plan cache


def plan(op: Operator, inputs: dict, backend: str, config: dict | None) -> Plan:
    """The checked plan for a call, cached per call signature: a repeated signature skips the checks and the
    backend choice. `inputs` leaves in the form the kernels take (op.prepare; the check applies it too)."""
    site = _SITES.get(op.name)
    if site is None:
        site = _SITES[op.name] = CallSite(op)
    found, key = site.find(inputs, backend, config)
    if found is not None:
        if found.prepare is not None:
            found.prepare(inputs)
        return found
    given = dict(inputs)  # the plan is keyed by the arguments as given, before op.prepare
    problem = op.check(inputs)
    device = device_of(inputs)
    views = any(inputs[name] is not value for name, value in given.items())  # what op.prepare did to them
    made = Plan(problem, *resolve(op, problem, devices.info(device), backend, config), device,
                op.prepare if views else None)
    if LOG_DECISIONS and (op.name, problem, device) not in _LOGGED:
        _LOGGED.add((op.name, problem, device))
        why = explain(op, problem, devices.info(device))[2] if backend == "auto" else "asked for"
        print(f"flashkern: {op.name} [{problem.key}] on {device}: {made.impl.name if made.impl else 'reference'} "
              f"{made.config or ''} ({why})", file=sys.stderr)
    if key is not None:
        site.add(key, given, made)
    return made


def _tensors(outputs) -> tuple:
    return (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)


def copy_into(out, result):
    """Copy a result into caller-provided outputs of the same structure; returns out."""
    for target, value in zip(_tensors(out), _tensors(result)):
        target.copy_(value)
    return out


def _checked_out(op: Operator, found: Plan, inputs: dict, out):
    """Caller-provided outputs: the structure, dtypes and shapes of op.outputs, contiguous, on the inputs' device,
    sharing no memory with an input (the kernels read inputs while they write outputs)."""
    if found.out_spec is None:
        found.out_spec = op.outputs(found.problem, inputs, "meta")
    expected = found.out_spec
    fields = getattr(expected, "_fields", None)
    if isinstance(expected, torch.Tensor):
        named = (("out", out, expected),)
    elif not isinstance(out, (tuple, list)) or len(out) != len(expected):
        raise TypeError(f"out must be a tuple of {len(expected)} tensors"
                        f"{' (' + ', '.join(fields) + ')' if fields else ''}, got {type(out).__name__}")
    else:
        named = tuple((f"out.{fields[i]}" if fields else f"out[{i}]", got, want)
                      for i, (got, want) in enumerate(zip(out, expected)))
    storages = {v.untyped_storage().data_ptr() for v in inputs.values() if isinstance(v, torch.Tensor)}
    for name, got, want in named:
        checks.tensor(name, got, dtype=want.dtype, shape=want.shape, device=found.device)
        if got.numel() and got.untyped_storage().data_ptr() in storages:
            raise ValueError(f"{name} shares memory with an input; pass a separate buffer")
    return type(expected)(*out) if fields else out


def run(op: Operator, inputs: dict, backend: str = "auto", config: dict | None = None, out=None):
    """One eager call: the plan (checked once per call signature), value checks in checked mode, the outputs
    (allocated, or the caller's `out`, which every backend writes in full), the kernel or the reference."""
    found = plan(op, inputs, backend, config)
    if op.check_values is not None and checks.checked_mode():
        op.check_values(inputs, found.problem)
    if out is None:
        out = op.outputs(found.problem, inputs, found.device)
    else:
        out = _checked_out(op, found, inputs, out)
    if found.impl is None:
        return copy_into(out, op.reference(**inputs))
    return found.impl.run(found.problem, inputs, found.config, out)


def call(op: Operator, arguments: dict):
    """An entry point's call, given its arguments (its `locals()`: the operator's inputs, backend, config, out;
    an operator that writes an input in place (op.mutates) takes no out and returns None).
    Eager: `run`. Under torch.compile: the custom op torch.ops.flashkern.<name> (flashkern.library), its result
    copied into `out` when one is given."""
    backend, config, out = arguments.pop("backend"), arguments.pop("config"), arguments.pop("out", None)
    if torch.compiler.is_compiling():
        result = library.traced_call(op, arguments, backend, config)
        return result if out is None else copy_into(out, result)
    result = run(op, arguments, backend, config, out)
    return None if op.mutates else result
