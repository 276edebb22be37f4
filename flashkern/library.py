"""Every operator as a torch custom op, `torch.ops.flashkern.<name>`, so that torch.compile can trace it.

The schema comes from the entry point's signature (its annotations and defaults), less `out` and with `config`
as a JSON string:

    flashkern::moe_route(Tensor logits, Tensor? bias=None, *, int top_k, str score="sqrtsoftplus", ...,
                         str backend="auto", str? config=None) -> (Tensor, Tensor)

Kernels: CPU and CUDA run the same path as an eager call (flashkern.dispatch.run: metadata checks, cached per
argument metadata; value checks in checked mode; the backend; outputs always freshly allocated, never aliasing
an input). Fake (meta): the metadata checks on the fake inputs, then the operator's output allocation, so a
traced graph gets the same argument errors and never touches data.

`flashkern.ops.<name>` calls the custom op while torch.compile traces it. Eager calls go straight to the
same path: the dispatcher's round trip (2.7 to 7.9 us on a 2-core CI machine, by the number of arguments) would
be more than the rest of the call's overhead (benchmarks/dispatch_overhead.py measures both).
"""

from __future__ import annotations

import functools
import inspect
import json
import types
import typing

import torch

from flashkern import checks

NAMESPACE = "flashkern"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
_OPS: dict[str, tuple] = {}  # name -> (OpOverload, positional parameters, keyword-only ones, result type)

_SCHEMA_TYPES = {torch.Tensor: "Tensor", int: "int", float: "float", bool: "bool", str: "str",
                 torch.dtype: "ScalarType"}
_DTYPE_DEFAULTS = {torch.float32: "float", torch.float64: "double", torch.int32: "int", torch.int64: "long"}


def _schema_type(name: str, annotation) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return _schema_type(name, inner) + "?"
    if annotation not in _SCHEMA_TYPES:
        raise TypeError(f"parameter {name!r}: no schema type for {annotation!r}")
    return _SCHEMA_TYPES[annotation]


def _schema_default(default) -> str:
    if isinstance(default, torch.dtype):
        return _DTYPE_DEFAULTS[default]
    return json.dumps(default) if isinstance(default, str) else repr(default)


def _result(annotation) -> tuple[str, type | None]:
    """The schema's return and the type to rebuild the result as (a NamedTuple), or None."""
    if annotation is None:  # an operator that writes one of its inputs in place
        return "()", None
    if annotation is torch.Tensor:
        return "Tensor", None
    fields = getattr(annotation, "_fields", None) or typing.get_args(annotation)
    return "(" + ", ".join(["Tensor"] * len(fields)) + ")", annotation if hasattr(annotation, "_fields") else None


class Parameter(typing.NamedTuple):
    name: str
    type: str  # its schema type: "Tensor", "Tensor?", "int", "float", ...
    default: typing.Any  # inspect.Parameter.empty when required
    keyword_only: bool


def parameters(entry) -> tuple[Parameter, ...]:
    """An annotated entry point's operator parameters (all but backend, config and out), in order."""
    found = []
    for param in inspect.signature(entry, eval_str=True).parameters.values():
        if param.name not in ("backend", "config", "out"):
            found.append(Parameter(param.name, _schema_type(param.name, param.annotation), param.default,
                                   param.kind is param.KEYWORD_ONLY))
    return tuple(found)


def schema(entry, mutates: str | None = None) -> tuple[str, type | None]:
    """(schema without the name, result type) from an annotated entry point; `mutates` names the tensor parameter
    it writes in place (Tensor(a!))."""
    parts, keyword_only = [], False
    for param in parameters(entry):
        if param.keyword_only and not keyword_only:
            parts.append("*")
            keyword_only = True
        text = f"{param.type}{'(a!)' if param.name == mutates else ''} {param.name}"
        if param.default is not inspect.Parameter.empty:
            text += "=" + _schema_default(param.default)
        parts.append(text)
    if not keyword_only:
        parts.append("*")
    parts += ['str backend="auto"', "str? config=None"]
    returns, result_type = _result(inspect.signature(entry, eval_str=True).return_annotation)
    return f"({', '.join(parts)}) -> {returns}", result_type


@functools.lru_cache(maxsize=256)
def _config(text: str) -> dict:
    """A config as the custom op's schema carries it (JSON), parsed once per distinct string; never mutated."""
    return json.loads(text)


def _as_result(value):
    return tuple(value) if isinstance(value, tuple) else value


def register(op) -> None:
    """Define torch.ops.flashkern.<op.name> with CPU, CUDA and fake kernels (once per process)."""
    from flashkern import dispatch

    text, result_type = schema(op.entry, op.mutates)
    params = parameters(op.entry)
    names = tuple(p.name for p in params)
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    keywords = tuple(p.name for p in params if p.keyword_only)
    _LIBRARY.define(op.name + text)

    def inputs_of(args, kwargs) -> dict:
        """The dispatcher passes positional parameters positionally, keyword-only ones by name unless defaulted."""
        inputs = {**defaults, **kwargs}
        inputs.update(zip(names, args))
        return inputs

    def run(*args, backend="auto", config=None, **kwargs):
        result = dispatch.run(op, inputs_of(args, kwargs), backend, None if config is None else _config(config))
        return None if op.mutates else _as_result(result)

    def fake(*args, backend="auto", config=None, **kwargs):
        inputs = inputs_of(args, kwargs)
        checks.choice("backend", backend, (*op.backends, "auto"))
        problem = op.check(inputs)
        return None if op.mutates else _as_result(op.empty_outputs(problem, inputs))

    for key in ("CPU", "CUDA"):
        _LIBRARY.impl(op.name, run, key)
    torch.library.register_fake(f"{NAMESPACE}::{op.name}", fake, lib=_LIBRARY)
    positional = tuple(name for name in names if name not in keywords)
    _OPS[op.name] = (getattr(getattr(torch.ops, NAMESPACE), op.name).default, positional, keywords, result_type)


def call_arguments(name: str, inputs: dict):
    """(torch.ops.flashkern.<name> overload, positional arguments, keyword arguments) for a call with `inputs`
    (keyed by the entry point's parameter names)."""
    overload, positional, keywords, _ = _OPS[name]
    return overload, tuple(inputs[n] for n in positional), {n: inputs[n] for n in keywords}


def traced_call(op, inputs: dict, backend: str, config):
    """What an entry point does under torch.compile: the custom op, its result rebuilt as the entry's type."""
    overload, args, kwargs = call_arguments(op.name, inputs)
    result = overload(*args, **kwargs, backend=backend,
                      config=None if config is None else json.dumps(config, sort_keys=True))
    result_type = _OPS[op.name][3]
    return result if result_type is None else result_type(*result)
