"""Every KIVI op, declared exactly once: ``torch.ops.kivi_xpu.<name>``.

Each :class:`OpDef` holds an op's schema (derived from the annotated signature of its reference implementation:
:func:`define`, :func:`schema_of`), its argument check (which names the bad argument) and its shape rule
(``outputs``: empty output tensors allocated like the inputs), from which follow the fake (meta) implementation for
``torch.compile`` / export and the output allocation of the device kernels. Implementations register per backend
with :func:`register_kernel` (``reference``: :mod:`.reference`, the pure-PyTorch default; ``native``: :mod:`.native`;
``sycl``: :mod:`.sycl`), in the manner of bitsandbytes; none re-declares a signature.

Dispatch of ``torch.ops.kivi_xpu.<name>`` follows the tensors' device:

* CPU tensors: the process's backend (``$KIVI_XPU_BACKEND``, default ``auto``: see :mod:`kivi_xpu.backend`), or the
  one set for this thread by :func:`use_backend`;
* XPU tensors: the SYCL kernels, on the Level Zero GPU of the tensors' index;
* any other device: the reference (one warning per device type); meta tensors: the fake.

A cache calls :func:`kernel` (the unchecked implementation of one backend: its internal hot path builds valid
arguments); tests and users call the checked ops, or :func:`for_backend` to pick a backend explicitly.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import inspect
import os
import threading
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

NAMESPACE = "kivi_xpu"
IMPLEMENTATIONS = {"reference": ".reference", "native": ".native", "sycl": ".sycl"}


@dataclass(frozen=True)
class OpDef:
    """One op: ``schema`` (arguments and returns, derived from the reference: :func:`schema_of`), the Python
    ``signature`` with the defaults of the reference implementation, ``arguments`` (a named tuple of the op's
    parameters, in order), and two rules that read the arguments by name: ``check_rule`` (raises naming the bad
    argument) and ``shape_rule`` (the empty output tensor(s), allocated like the inputs)."""

    name: str
    schema: str
    signature: inspect.Signature
    arguments: type
    check_rule: Callable[[tuple], None]
    shape_rule: Callable[[tuple], object]

    def check(self, *args) -> None:
        """Raises, naming the argument, unless ``args`` (all of the op's, in order) are valid."""
        self.check_rule(self.arguments(*args))

    def outputs(self, *args):
        """The op's empty output tensor(s) for ``args`` (all of the op's, in order)."""
        return self.shape_rule(self.arguments(*args))


OPS: dict[str, OpDef] = {}
_KERNELS: dict[tuple[str, str], Callable] = {}
_DIRECT: dict[tuple[str, str], Callable] = {}
_lib = torch.library.Library(NAMESPACE, "DEF")


def register_kernel(op: str, backend: str):
    """Decorator: ``fn`` implements ``op`` for ``backend`` (same arguments as the op, already checked)."""
    if backend not in IMPLEMENTATIONS:
        raise ValueError(f"`backend` must be one of {tuple(IMPLEMENTATIONS)}, got {backend!r}")

    def register(fn: Callable) -> Callable:
        _KERNELS[(op, backend)] = fn
        return fn

    return register


def kernel(op: str, backend: str) -> Callable:
    """The unchecked implementation of ``op`` for ``backend`` ("reference", "native" or "sycl")."""
    fn = _KERNELS.get((op, backend))
    if fn is None:
        if op not in OPS:
            raise ValueError(f"`op` must be one of {tuple(OPS)}, got {op!r}")
        if backend not in IMPLEMENTATIONS:
            raise ValueError(f"`backend` must be one of {tuple(IMPLEMENTATIONS)}, got {backend!r}")
        importlib.import_module(IMPLEMENTATIONS[backend], __package__)  # registers that backend's kernels
        fn = _KERNELS.get((op, backend))
        if fn is None:  # e.g. the unfused attention ops, which the native backend does not need
            _warn_reference_once(f"{op!r} on the {backend!r} backend")
            fn = _KERNELS[(op, backend)] = kernel(op, "reference")
    return fn


def register_direct(op: str, backend: str):
    """Decorator: ``pick(*like)`` returns a callable that runs ``op`` on ``backend`` for arguments stored like
    ``like`` with no Python frame in between (the native extension's own function), or ``None`` (then
    :func:`direct_kernel` gives :func:`kernel`)."""

    def register(pick: Callable) -> Callable:
        _DIRECT[(op, backend)] = pick
        return pick

    return register


def direct_kernel(op: str, backend: str, *like) -> Callable:
    """:func:`kernel` for a hot path that keeps it for many calls on arguments stored like ``like``: the backend's
    direct callable where it has one (see :func:`register_direct`): a Python wrapper frame is a measurable share of
    a decode step in the model (docs/measurements.md), where the layers' weights pass through the caches between
    two calls of the same layer."""
    fn = kernel(op, backend)  # (imports the backend, which registers its direct callables)
    pick = _DIRECT.get((op, backend))
    direct = pick(*like) if pick is not None else None
    return fn if direct is None else direct


def _bind(op: OpDef, args, kwargs) -> tuple:
    bound = op.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.args


def call(op: str, backend: str, *args, **kwargs):
    """``op`` on ``backend`` with the op's argument check (the defaults of the reference signature apply)."""
    spec = OPS[op]
    args = _bind(spec, args, kwargs)
    spec.check(*args)
    return kernel(op, backend)(*args)


def takes_arguments_of(op: str):
    """Decorator for an implementation of ``op`` written over its arguments in order, ``fn(*args)`` (a twin kept
    outside the registry): the result takes them by name too, with the op's signature and defaults."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            return fn(*_bind(OPS[op], args, kwargs))

        run.__signature__ = OPS[op].signature
        return run

    return wrap


class BackendOps:
    """The checked ops of one backend as methods: ``for_backend("sycl").quantize_keys(x, 32, 2)``."""

    def __init__(self, backend: str):
        if backend not in IMPLEMENTATIONS:
            raise ValueError(f"`backend` must be one of {tuple(IMPLEMENTATIONS)}, got {backend!r}")
        self.backend = backend

    def __getattr__(self, op: str):
        if op not in OPS:
            raise AttributeError(f"no op {op!r}; ops: {tuple(OPS)}")
        return functools.partial(call, op, self.backend)

    def __repr__(self) -> str:
        return f"BackendOps({self.backend!r})"


def for_backend(backend: str) -> BackendOps:
    return BackendOps(backend)


# ---- dispatch of torch.ops.kivi_xpu.* ---------------------------------------------------------------------------

_thread = threading.local()


@contextlib.contextmanager
def use_backend(backend: str):
    """Within the block, ``torch.ops.kivi_xpu.*`` on CPU tensors runs ``backend``'s kernels on this thread."""
    if backend not in IMPLEMENTATIONS:
        raise ValueError(f"`backend` must be one of {tuple(IMPLEMENTATIONS)}, got {backend!r}")
    previous = getattr(_thread, "backend", None)
    _thread.backend = backend
    try:
        yield
    finally:
        _thread.backend = previous


@functools.cache
def _process_cpu_backend(env_value: str | None) -> str:
    from ..backend import select  # the choice of backend is not the ops' business; imported late, once

    return select().name


def cpu_backend() -> str:
    """The backend serving ``torch.ops.kivi_xpu.*`` on CPU tensors now."""
    return getattr(_thread, "backend", None) or _process_cpu_backend(os.environ.get("KIVI_XPU_BACKEND"))


@functools.cache
def _warn_reference_once(what: str) -> None:
    warnings.warn(
        f"kivi_xpu: no fast kernel for {what}: it runs the pure-PyTorch reference",
        RuntimeWarning,
        stacklevel=4,
    )


def _first_tensor(args) -> torch.Tensor:
    return next(a for a in args if isinstance(a, torch.Tensor))


def _dispatcher(op: OpDef, which: str):
    def run(*args):
        op.check(*args)
        if which == "cpu":
            backend = cpu_backend()
        elif which == "xpu":
            backend = "sycl"
        else:
            _warn_reference_once(f"{_first_tensor(args).device.type} tensors")
            backend = "reference"
        return kernel(op.name, backend)(*args)

    run.__name__ = f"{op.name}_{which}"
    return run


def _fake(op: OpDef):
    def fake(*args):
        args = op.arguments(*args)
        op.check_rule(args)
        return op.shape_rule(args)

    return fake


# The schema types of the reference's annotations. Integers are ``int``, not the ``SymInt`` of
# torch.library.infer_schema: the kernels take plain integers, and the declared schemas have always said so.
_SCHEMA_TYPES = {
    torch.Tensor: "Tensor",
    torch.Tensor | None: "Tensor?",
    int: "int",
    float: "float",
    bool: "bool",
    str: "str",
    torch.dtype: "ScalarType",
}


def schema_of(signature: inspect.Signature, mutates: tuple[str, ...] = (), views: tuple[str, ...] = ()) -> str:
    """The op schema of an annotated reference ``signature`` (its annotations evaluated). ``mutates``: the tensor
    arguments written in place (aliases ``a!``, ``b!``, ... in order); ``views``: for an op returning views of
    mutated arguments, the argument each returned tensor is a view of. The optional tensors that end the argument
    list keep their ``None`` default, and so do the strings among them (a call of the op may leave them out); the
    reference's other defaults are conveniences of its Python callers (:func:`call`), not of the op."""
    aliases = {name: chr(ord("a") + i) for i, name in enumerate(mutates)}
    parameters = list(signature.parameters.values())
    optional = len(parameters)
    while optional and (parameters[optional - 1].default is None or isinstance(parameters[optional - 1].default, str)):
        optional -= 1
    arguments = []
    for i, p in enumerate(parameters):
        kind = _SCHEMA_TYPES[p.annotation] + (f"({aliases[p.name]}!)" if p.name in aliases else "")
        default = "" if i < optional else "=None" if p.default is None else f'="{p.default}"'
        arguments.append(f"{kind} {p.name}{default}")
    returns = signature.return_annotation
    if views:
        out = "(" + ", ".join(f"Tensor({aliases[name]})" for name in views) + ")"
    elif returns is None:
        out = "()"
    elif typing.get_origin(returns) is tuple:
        out = "(" + ", ".join(_SCHEMA_TYPES[t] for t in typing.get_args(returns)) + ")"
    else:
        out = _SCHEMA_TYPES[returns]
    return f"({', '.join(arguments)}) -> {out}"


def define(
    name: str,
    reference: Callable,
    check: Callable[[tuple], None],
    outputs: Callable[[tuple], object],
    *,
    mutates: tuple[str, ...] = (),
    views: tuple[str, ...] = (),
) -> None:
    """Declares op ``name`` from its annotated ``reference`` (a function of :mod:`.reference`, which writes the op's
    signature once: the schema, the Python defaults and the argument names follow from it), ``check(args)`` and
    ``outputs(args)`` (the shape rule), both given the arguments as the op's named tuple; ``mutates`` and ``views``
    as for :func:`schema_of`."""
    signature = inspect.signature(reference, eval_str=True)
    parameters = list(signature.parameters.values())
    defaulted = len(parameters)
    while defaulted and parameters[defaulted - 1].default is not inspect.Parameter.empty:
        defaulted -= 1  # (torch leaves out the arguments a schema gives defaults: the named tuple has them too)
    defaults = [p.default for p in parameters[defaulted:]]
    arguments = collections.namedtuple(f"{name}_arguments", signature.parameters, defaults=defaults)
    op = OpDef(name, schema_of(signature, mutates, views), signature, arguments, check, outputs)
    OPS[name] = op
    _lib.define(name + op.schema)
    _lib.impl(name, _dispatcher(op, "cpu"), "CPU")
    _lib.impl(name, _dispatcher(op, "xpu"), "XPU")
    _lib.impl(name, _dispatcher(op, "other"), "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", _fake(op), lib=_lib)
