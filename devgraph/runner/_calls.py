"""How a GraphRunner reads a call: which arguments are batched, static, host lists or constants."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import struct
import sys
import types
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from devgraph.graph import holds_tensor
from devgraph.runner._config import RunnerConfig

__all__ = ["Call", "CallReader", "Unsupported", "TemplateCheck", "template_mismatch"]


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
    #: the call's arguments by parameter name, defaults applied (``BoundArguments.arguments``).
    arguments: dict[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    def template(self, config: RunnerConfig) -> dict[str, Any]:
        """What must stay the same between the captured call and a replayed one."""
        t: dict[str, Any] = {}
        dims = dict(config.batch_dims)
        for name, x in self.batched.items():
            d = dims.get(name, 0)
            shape = x.shape
            t[name] = ("batched", tuple(shape[:d]) + tuple(shape[d + 1 :]), x.dtype, x.device)
        for name, x in self.static.items():
            t[name] = static_key(x)
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


#: types whose values compare and hash by value and cannot change: keyed as ``(type, value)``.
_PLAIN = frozenset(
    {
        int,
        float,
        bool,
        complex,
        str,
        bytes,
        type(None),
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
    }
)
#: compared by identity: code and classes (what they compute is not data the call passes).
_BY_IDENTITY = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    type,
    enum.Enum,
    torch.nn.Module,
)


def static_key(x: torch.Tensor) -> tuple[Any, ...]:
    """What a static tensor argument is matched by: everything that decides what a captured kernel
    reads through it (address, storage offset, shape, strides, dtype, device, the conjugate and
    negative bits). ``w`` and ``w.t()`` of a square ``w`` share address, shape and dtype and differ
    in strides; ``z`` and ``z.conj()`` differ only in the conjugate bit."""
    return (
        "static",
        x.data_ptr(),
        x.storage_offset(),
        tuple(x.shape),
        x.stride(),
        x.dtype,
        x.device,
        x.is_conj(),
        x.is_neg(),
    )


#: the static key's fields after "static", named in a mismatch message.
_STATIC_FIELDS = (
    "address",
    "storage offset",
    "shape",
    "strides",
    "dtype",
    "device",
    "conjugate bit",
    "negative bit",
)

_pack_double = struct.Struct("<d").pack


def _plain_key(t: type, v: Any) -> Any:
    """A plain value's key. Floats and complexes by their bits: ``0.0 == -0.0`` and NaN is unequal
    to itself, yet a kernel given ``-0.0`` or a NaN computes other bits than one given ``0.0``."""
    if t is float:
        return (t, _pack_double(v))
    if t is complex:
        return (t, _pack_double(v.real) + _pack_double(v.imag))
    return (t, v)


def _const_key(v: Any) -> Any:
    """What a constant argument is compared by between the captured call and a later one: its type
    and value (``1.0`` and ``1`` differ), containers item by item, NumPy arrays by their bytes,
    dataclasses and plain objects by their fields (a mutated object no longer matches).

    Raises:
        Unsupported: a constant holding a tensor, or one that cannot be compared by value.
    """
    t = type(v)
    if t in _PLAIN:
        return _plain_key(t, v)
    return _value_key(v, 0)


def _value_key(v: Any, depth: int) -> Any:
    t = type(v)
    if t in _PLAIN:
        return _plain_key(t, v)
    if isinstance(v, torch.Tensor):
        raise Unsupported(
            "unsupported_call",
            "a constant argument holds a tensor (inside a dataclass or object); pass tensors as separate "
            "arguments",
        )
    if depth > 32:
        raise Unsupported("unsupported_call", f"a constant {t.__name__} is nested too deeply to compare")
    if t in (tuple, list) or (isinstance(v, tuple) and hasattr(v, "_fields")):
        return (t, tuple(_value_key(e, depth + 1) for e in v))
    if isinstance(v, dict):
        return (t, tuple((_value_key(k, depth + 1), _value_key(e, depth + 1)) for k, e in v.items()))
    if isinstance(v, (set, frozenset)):
        return (t, frozenset(_value_key(e, depth + 1) for e in v))
    if isinstance(v, _BY_IDENTITY):
        return (t, id(v), v)
    if t.__module__ == "numpy":
        if hasattr(v, "tobytes") and hasattr(v, "shape") and getattr(v, "dtype", None) is not None:
            if v.dtype.hasobject:
                return (t, v.shape, _value_key(v.tolist(), depth + 1))
            return (t, v.dtype.str, v.shape, v.tobytes())
    if dataclasses.is_dataclass(v):
        return (t, tuple((f.name, _value_key(getattr(v, f.name), depth + 1)) for f in dataclasses.fields(v)))
    if t.__hash__ is object.__hash__ or t.__hash__ is None:  # identity hash or none: compare its state
        state = getattr(v, "__dict__", None)
        slots = [
            s for k in t.__mro__ for s in getattr(k, "__slots__", ()) if s not in ("__dict__", "__weakref__")
        ]
        if state is None and not slots:
            if t.__hash__ is None:
                raise Unsupported(
                    "unsupported_call", f"a constant {t.__name__} cannot be compared between calls"
                )
            return (t, id(v), v)  # no state at all (a sentinel object()): identity is its value
        fields = dict(state or {})
        fields.update((s, getattr(v, s)) for s in slots if hasattr(v, s))
        return (t, id(v), _value_key(fields, depth + 1))
    return (t, v)  # its own hash and equality: a value type


class CallReader:
    """Reads the calls of one function under one ``RunnerConfig`` into ``Call`` objects.

    ``inspect.Signature.bind`` costs more than the rest of a call's reading, and where each
    argument lands depends only on the call's *shape* (how many positional arguments, which
    keywords), not on the values. So the first call of each shape is bound in full, and the way
    it bound (argument ``i`` -> parameter ``x``, keyword ``k`` -> ``**kwargs``, defaults) is kept
    and replayed for later calls of that shape; a shape that fails to bind is never kept. The
    result is the same ``Call`` either way (a test compares both paths on kwargs, defaults,
    ``*args``, ``**kwargs`` and non-tensor arguments).
    """

    #: call shapes remembered at most (a caller that varies its keywords endlessly binds in full).
    MAX_SHAPES = 64

    def __init__(self, signature: inspect.Signature, config: RunnerConfig) -> None:
        self.signature = signature
        self.config = config
        self._host_names = {name for name, _ in config.host_args}
        self._static_names = set(config.static_args)
        self.batch_dims = dict(config.batch_dims)
        self.pad_values = dict(config.pad_values)
        self._shapes: dict[tuple[int, tuple[str, ...]], tuple[tuple[str, int, Any], ...] | None] = {}

    def read(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        """The call ``fn(*args, **kwargs)``, classified.

        Raises:
            Unsupported: the arguments do not bind, or the call cannot be served from a graph.
        """
        plan = self._shapes.get((len(args), tuple(kwargs)))
        if plan is None:
            return self._classify(*self.bind(args, kwargs))
        if plan is _KEYWORDS_AS_GIVEN:  # f(**batch): the flat arguments are the keywords
            return self._classify(kwargs, None)
        flat = {
            name: args[where] if where >= 0 else kwargs[key] if where == _KEYWORD else key
            for name, where, key in plan
        }
        return self._classify(flat, None)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The call's arguments flattened (``args[i]``, ``**kwargs`` keys), and by parameter.

        Raises:
            Unsupported: the arguments do not match the signature.
        """
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise Unsupported("unsupported_call", f"arguments do not match the signature: {exc}") from None
        bound.apply_defaults()  # f(x) and f(x, scale=1.0) are the same call
        flat = _flat_arguments(bound)
        shape = (len(args), tuple(kwargs))
        if shape not in self._shapes and len(self._shapes) < self.MAX_SHAPES:
            plan = _binding_plan(self.signature, args, kwargs)
            # Kept only when replaying it gives exactly what bind gave (same names, same objects).
            replayed = [args[w] if w >= 0 else kwargs[k] if w == _KEYWORD else k for _, w, k in plan]
            same = [n for n, _, _ in plan] == list(flat) and all(
                a is b for a, b in zip(replayed, flat.values())
            )
            if same and not args and [n for n, _, _ in plan] == list(kwargs):
                plan = _KEYWORDS_AS_GIVEN
            self._shapes[shape] = plan if same else None
        return flat, dict(bound.arguments)

    def arguments(self, call: Call) -> dict[str, Any]:
        """The call's arguments by parameter name (for ``is_decode``), rebuilt from its flat names."""
        if call.arguments:
            return call.arguments
        params = self.signature.parameters
        values = {**call.batched, **call.static, **call.host, **call.consts}
        out: dict[str, Any] = {}
        for name in call.order:
            owner, key = _split_name(name, params)
            kind = params[owner].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                out[owner] = (*out.get(owner, ()), values[name])
            elif kind is inspect.Parameter.VAR_KEYWORD:
                out.setdefault(owner, {})[key] = values[name]
            else:
                out[owner] = values[name]
        for p in params.values():  # empty *args / **kwargs, as apply_defaults gives them
            if p.kind is inspect.Parameter.VAR_POSITIONAL:
                out.setdefault(p.name, ())
            elif p.kind is inspect.Parameter.VAR_KEYWORD:
                out.setdefault(p.name, {})
        return {p: out[p] for p in params if p in out}

    def _classify(self, arguments: dict[str, Any], by_param: dict[str, Any] | None) -> Call:
        host_names, static_names, dims = self._host_names, self._static_names, self.batch_dims
        tensor = torch.Tensor
        batched: dict[str, torch.Tensor] = {}
        static: dict[str, torch.Tensor] = {}
        host: dict[str, list[Any]] = {}
        consts: dict[str, Any] = {}
        for name, value in arguments.items():
            if isinstance(value, tensor):
                (static if name in static_names else batched)[name] = value
            elif name in host_names:
                if not isinstance(value, (list, tuple)):
                    raise Unsupported(
                        "unsupported_call",
                        f"host argument {name!r} must be a list, got {type(value).__name__}",
                    )
                host[name] = value if type(value) is list else list(value)  # padding copies it again
            elif holds_tensor(value):
                raise Unsupported(
                    "unsupported_call",
                    f"argument {name!r} holds tensors inside a {type(value).__name__}; pass tensors as separate "
                    "arguments (or mark the call eager)",
                )
            else:
                consts[name] = value
        batch = -1
        for name, x in batched.items():
            d = dims.get(name, 0)
            try:
                rows = x.shape[d]
            except IndexError:
                raise Unsupported(
                    "unsupported_call", f"argument {name!r} has {x.dim()} dims, batch dim is {d}"
                ) from None
            if batch < 0:
                batch = rows
            elif rows != batch:
                sizes = {n: t.shape[dims.get(n, 0)] for n, t in batched.items()}
                raise Unsupported(
                    "unsupported_call", f"batched arguments disagree on the batch size: {sizes}"
                )
        if batch < 0:
            raise Unsupported("unsupported_call", "no batched tensor argument (nothing to bucket by)")
        for name, values in host.items():
            if len(values) != batch:
                raise Unsupported(
                    "unsupported_call", f"host argument {name!r} has {len(values)} values for batch {batch}"
                )
        return Call(batch, batched, static, host, consts, tuple(arguments), by_param or {})


#: the binding plan of a call of keywords only, in the signature's order, none defaulted.
_KEYWORDS_AS_GIVEN: tuple[tuple[str, int, Any], ...] = (("", 0, None),)

#: ``where`` in a binding plan: the value comes from a keyword (>= 0: that positional index;
#: ``_DEFAULT``: ``key`` is the default value itself).
_KEYWORD = -1
_DEFAULT = -2


def _binding_plan(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[str, int, Any], ...]:
    """For a call that binds, where each flat argument comes from: ``(flat name, where, key)``."""
    plan: list[tuple[str, int, Any]] = []
    params = list(signature.parameters.values())
    named = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    positional = 0
    for p in params:
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            if positional < len(args):
                plan.append((p.name, positional, None))
                positional += 1
            elif p.kind is not inspect.Parameter.POSITIONAL_ONLY and p.name in kwargs:
                plan.append((p.name, _KEYWORD, p.name))
            else:
                plan.append((p.name, _DEFAULT, p.default))
        elif p.kind is inspect.Parameter.VAR_POSITIONAL:
            plan.extend((f"{p.name}[{i}]", positional + i, None) for i in range(len(args) - positional))
        elif p.kind is inspect.Parameter.KEYWORD_ONLY:
            plan.append((p.name, _KEYWORD, p.name) if p.name in kwargs else (p.name, _DEFAULT, p.default))
        else:  # VAR_KEYWORD
            plan.extend((k, _KEYWORD, k) for k in kwargs if k not in named)
    return tuple(plan)


class TemplateCheck:
    """``call.template(config) == captured``, answered without building the call's template.

    Per batch size it keeps each batched argument's full expected shape, so a tensor costs one
    shape comparison (which also checks the batch dim), a dtype and a device comparison.
    """

    def __init__(self, captured: dict[str, Any], dims: Mapping[str, int]) -> None:
        self.captured = captured
        self.dims = dims
        self._expected: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype, torch.device]]] = {}

    def _for_batch(self, batch: int) -> dict[str, tuple[tuple[int, ...], torch.dtype, torch.device]]:
        expected = self._expected.get(batch)
        if expected is None:
            expected = {}
            for name, want in self.captured.items():
                if want[0] == "batched":
                    shape = list(want[1])
                    shape.insert(self.dims.get(name, 0), batch)
                    expected[name] = (tuple(shape), want[2], want[3])
            if len(self._expected) < 4096:
                self._expected[batch] = expected
        return expected

    def matches(self, call: Call) -> bool:
        captured = self.captured
        if len(captured) != len(call.order):
            return False
        expected = self._for_batch(call.batch)
        for name, x in call.batched.items():
            want = expected.get(name)
            if want is None or x.shape != want[0] or x.dtype != want[1] or x.device != want[2]:
                return False
        for name, x in call.static.items():
            if captured.get(name) != static_key(x):
                return False
        for name in call.host:
            if captured.get(name) != ("host",):
                return False
        for name, v in call.consts.items():
            if captured.get(name) != ("const", _const_key(v)):
                return False
        return True


def template_mismatch(captured: dict[str, Any], call: dict[str, Any]) -> str | None:
    """A sentence naming the first difference between two call templates, or None."""
    if captured == call:
        return None
    if set(captured) != set(call):
        return f"arguments {sorted(call)} differ from the captured {sorted(captured)}"
    for name, want in captured.items():
        got = call[name]
        if want != got:
            if want[0] == "static" == got[0]:
                differ = [
                    f"{field} {g!r}, at capture {w!r}"
                    for field, w, g in zip(_STATIC_FIELDS, want[1:], got[1:])
                    if w != g
                ]
                return (
                    f"static argument {name!r} is not the captured tensor ({'; '.join(differ)}); a graph reads "
                    "a static argument where and as it was at capture"
                )
            if want[0] == "const" == got[0]:
                return f"argument {name!r} is {_words(got[1])} at capture it was {_words(want[1])}"
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


def _words(key: Any) -> str:
    """A constant's key (``_const_key``) for an error message: ``1.0 (float)``."""
    if isinstance(key, tuple) and len(key) == 2 and key[0] in (float, complex) and type(key[1]) is bytes:
        parts = struct.unpack(f"<{len(key[1]) // 8}d", key[1])
        value = parts[0] if key[0] is float else complex(*parts)
        return f"{value!r} ({key[0].__name__})"
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], type):
        return f"{key[1]!r} ({key[0].__name__})"
    if isinstance(key, tuple) and key and isinstance(key[0], type):
        return f"a {key[0].__name__} with other contents"
    return repr(key)
