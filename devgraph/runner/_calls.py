"""How a GraphRunner reads a call: which arguments are batched, static, host lists or constants."""

from __future__ import annotations

import inspect
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from devgraph._tasks import holds_tensor
from devgraph.runner._config import RunnerConfig

__all__ = ["Call", "Unsupported", "read_call", "template_mismatch"]


class Unsupported(Exception):
    """A call the runner cannot serve from a graph; ``category`` keys the fallback counters."""

    def __init__(self, category: str, detail: str) -> None:
        self.category = category
        self.detail = detail
        super().__init__(detail)


@attrs.frozen
class Call:
    """One call, classified.

    ``batched``: name -> tensor (batch along ``config.batch_dim(name)``); ``static``: tensors passed
    as they are; ``host``: host lists with one value per row; ``consts``: everything else.
    """

    batch: int
    batched: dict[str, torch.Tensor]
    static: dict[str, torch.Tensor]
    host: dict[str, list[Any]]
    consts: dict[str, Any]
    order: tuple[str, ...]

    def template(self, config: RunnerConfig) -> dict[str, Any]:
        """What must stay the same between the captured call and a replayed one."""
        t: dict[str, Any] = {}
        for name, x in self.batched.items():
            d = config.batch_dim(name)
            t[name] = ("batched", tuple(x.shape[:d]) + tuple(x.shape[d + 1 :]), x.dtype, x.device)
        for name, x in self.static.items():
            t[name] = ("static", x.data_ptr(), tuple(x.shape), x.dtype)
        for name in self.host:
            t[name] = ("host",)
        for name, v in self.consts.items():
            t[name] = ("const", _const_key(v))
        return t

    def bind(
        self, signature: inspect.Signature, values: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` calling the function with ``values`` in this call's argument order."""
        arguments: OrderedDict[str, Any] = OrderedDict()
        params = signature.parameters
        for name in self.order:
            owner, key = _split_name(name, params)
            param = params[owner]
            if param.kind is inspect.Parameter.VAR_POSITIONAL:
                arguments[owner] = (*arguments.get(owner, ()), values[name])
            elif param.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.setdefault(owner, {})[key] = values[name]
            else:
                arguments[owner] = values[name]
        bound = inspect.BoundArguments(signature, arguments)
        return bound.args, bound.kwargs


def _split_name(name: str, params: Mapping[str, inspect.Parameter]) -> tuple[str, str]:
    """The parameter an argument name belongs to, and its key there: ``"x"`` -> ``("x", "x")``,
    ``"args[1]"`` -> ``("args", "1")`` (``*args``), ``"mask"`` -> ``("kwargs", "mask")`` (``**kwargs``)."""
    if name in params:
        return name, name
    head, bracket, rest = name.partition("[")
    if bracket and head in params and params[head].kind is inspect.Parameter.VAR_POSITIONAL:
        return head, rest[:-1]
    varkw = next(p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD)
    return varkw, name


def _flat_arguments(bound: inspect.BoundArguments) -> dict[str, Any]:
    """``bound``'s arguments by name, with ``*args`` spread as ``args[0]``, ``args[1]``... and
    ``**kwargs`` as their own keywords, so each one can be batched, static or a host list."""
    flat: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            flat.update((f"{name}[{i}]", v) for i, v in enumerate(value))
        elif kind is inspect.Parameter.VAR_KEYWORD:
            flat.update(value)
        else:
            flat[name] = value
    return flat


def _const_key(v: Any) -> Any:
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


def read_call(
    signature: inspect.Signature, config: RunnerConfig, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Call:
    """Classify a call's arguments; raise ``Unsupported`` when it cannot be served from a graph."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise Unsupported("unsupported_call", f"arguments do not match the signature: {exc}") from None
    bound.apply_defaults()  # f(x) and f(x, scale=1.0) are the same call
    host_names = dict(config.host_args)
    static_names = set(config.static_args)
    batched: dict[str, torch.Tensor] = {}
    static: dict[str, torch.Tensor] = {}
    host: dict[str, list[Any]] = {}
    consts: dict[str, Any] = {}
    arguments = _flat_arguments(bound)
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            (static if name in static_names else batched)[name] = value
        elif name in host_names:
            if not isinstance(value, (list, tuple)):
                raise Unsupported(
                    "unsupported_call", f"host argument {name!r} must be a list, got {type(value).__name__}"
                )
            host[name] = list(value)
        elif holds_tensor(value):
            raise Unsupported(
                "unsupported_call",
                f"argument {name!r} holds tensors inside a {type(value).__name__}; pass tensors as separate "
                "arguments (or mark the call eager)",
            )
        else:
            consts[name] = value
    sizes = {}
    for name, x in batched.items():
        d = config.batch_dim(name)
        if x.dim() <= d:
            raise Unsupported("unsupported_call", f"argument {name!r} has {x.dim()} dims, batch dim is {d}")
        sizes[name] = x.shape[d]
    if not sizes:
        raise Unsupported("unsupported_call", "no batched tensor argument (nothing to bucket by)")
    batch = next(iter(sizes.values()))
    if any(s != batch for s in sizes.values()):
        raise Unsupported("unsupported_call", f"batched arguments disagree on the batch size: {sizes}")
    for name, values in host.items():
        if len(values) != batch:
            raise Unsupported(
                "unsupported_call", f"host argument {name!r} has {len(values)} values for batch {batch}"
            )
    return Call(batch, batched, static, host, consts, tuple(arguments))


def template_mismatch(captured: dict[str, Any], call: dict[str, Any]) -> str | None:
    """A sentence naming the first difference between two call templates, or None."""
    if set(captured) != set(call):
        return f"arguments {sorted(call)} differ from the captured {sorted(captured)}"
    for name, want in captured.items():
        got = call[name]
        if want != got:
            if want[0] == "static":
                return f"static argument {name!r} is not the captured tensor"
            return f"argument {name!r} is {got[1:]} at capture it was {want[1:]}"
    return None


def signature_of(fn: Callable[..., Any]) -> inspect.Signature:
    """The signature calls of ``fn`` are read with: a module's ``forward``; for a ``torch.compile``'d
    module (whose own ``forward`` takes ``*args, **kwargs``), the compiled module's ``forward``."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled
    while eval_frame is not None and isinstance(fn, eval_frame.OptimizedModule):
        fn = fn._orig_mod
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    return inspect.signature(target)
