"""Splitting ops: name resolution, keeping composite ops whole while tracing, host arguments.

Three jobs, all about the ops the graph is cut at:

* ``resolve_splitting_ops`` turns user spellings into canonical ``"namespace::op[.overload]"``
  names, checking each exists in ``torch.ops`` (an unknown name is a ``DevgraphError`` that says how
  to spell one).
* An op with a ``CompositeImplicitAutograd`` kernel (``aten::scaled_dot_product_attention``)
  decomposes while the graph is lowered to aten ops, so it would vanish before the split. Before
  lowering, its calls are re-targeted to an *opaque twin* (``devgraph_opaque::<ns>__<op>``, same
  schema, a kernel that calls the original) which lowering keeps whole.
* Host-list arguments (``seq_lens_host``) cannot be traced: Dynamo would bake their values (and their
  length, the batch size) into the graph. The trace sees an empty list; ``bind_host_args`` then
  replaces it, in every op that takes it, with a ``host_arg(name)`` call that reads the values the
  runner set for this call (``host_values``).
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from devgraph.graph import lookup_op

__all__ = [
    "SYM_OPS",
    "DEFAULT_SPLITTING_OPS",
    "bind_host_args",
    "host_arg",
    "host_values",
    "is_getitem",
    "is_host_arg_node",
    "is_splitting_node",
    "keep_composite_ops_whole",
    "op_names_of",
    "resolve_splitting_ops",
]

#: Shape queries: host-side arithmetic on sizes, no device work.
SYM_OPS = frozenset(
    {
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_storage_offset.default,
    }
)

#: devgraph's attention ops: always split at (they read host arguments on cpu and npu).
DEFAULT_SPLITTING_OPS = ("devgraph::paged_decode_attention",)

OPAQUE_NAMESPACE = "devgraph_opaque"

_SPELLING = (
    "spell splitting ops 'namespace::op' or 'namespace::op.overload', e.g. "
    "'devgraph::paged_decode_attention' or 'aten::scaled_dot_product_attention'; an engine's custom op "
    "must be registered (its module imported) before devgraph compiles the model"
)


def _lookup(name: str) -> tuple[Any, str | None]:
    """``(OpOverloadPacket, overload or None)`` for ``"ns::op[.overload]"``; raises DevgraphError."""
    return lookup_op(name, "splitting op", _SPELLING)


def resolve_splitting_ops(extra: Sequence[str] = ()) -> tuple[str, ...]:
    """``DEFAULT_SPLITTING_OPS`` then ``extra``, each checked against ``torch.ops``.

    Raises:
        DevgraphError: a name that is not ``"namespace::op[.overload]"`` or names no registered op.
    """
    import devgraph.ops  # noqa: F401  (defines the devgraph namespace)

    names = []
    for name in (*DEFAULT_SPLITTING_OPS, *extra):
        _lookup(name)
        names.append(name[: -len(".default")] if name.endswith(".default") else name)
    return tuple(dict.fromkeys(names))


def op_names_of(target: Any) -> tuple[str, ...]:
    """The names a node target answers to: ``("ns::op", "ns::op.overload")`` for an OpOverload."""
    if isinstance(target, torch._ops.OpOverload):
        base = target._schema.name
        original = _OPAQUE_ORIGINALS.get(base)
        if original is not None:
            return original
        return (base, f"{base}.{target._overloadname}")
    return ()


def is_splitting_node(node: fx.Node, names: Sequence[str]) -> bool:
    """Whether ``node`` calls one of the ops ``names`` (canonical splitting op names)."""
    return node.op == "call_function" and any(n in names for n in op_names_of(node.target))


# -- composite ops kept whole ------------------------------------------------------------------

_lock = threading.Lock()
_lib: torch.library.Library | None = None
_OPAQUE: dict[str, Any] = {}  # original "ns::op.overload" -> opaque OpOverload
_OPAQUE_ORIGINALS: dict[str, tuple[str, ...]] = {}  # opaque schema name -> names of the original


def _is_composite(overload: Any) -> bool:
    name = overload._schema.name
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")


def _opaque_twin(overload: Any) -> Any:
    """An op with ``overload``'s schema whose kernel calls ``overload`` (so lowering keeps it whole)."""
    global _lib
    base = overload._schema.name
    key = f"{base}.{overload._overloadname}"
    with _lock:
        if key in _OPAQUE:
            return _OPAQUE[key]
        if _lib is None:
            _lib = torch.library.Library(OPAQUE_NAMESPACE, "FRAGMENT")
        suffix = "" if overload._overloadname == "default" else f"_{overload._overloadname}"
        name = base.replace("::", "__") + suffix
        schema = str(overload._schema)
        schema = name + schema[schema.index("(") :]
        qual = f"{OPAQUE_NAMESPACE}::{name}"
        try:
            torch._C._dispatch_find_schema_or_throw(qual, "")
        except RuntimeError:
            _lib.define(schema)

            def kernel(*args: Any, **kwargs: Any) -> Any:
                return overload(*args, **kwargs)

            _lib.impl(name, kernel, "CompositeExplicitAutograd")
            torch.library.register_fake(qual, kernel, lib=_lib)
        twin = getattr(getattr(torch.ops, OPAQUE_NAMESPACE), name).default
        _OPAQUE[key] = twin
        _OPAQUE_ORIGINALS[qual] = (base, key)
        return twin


def _composite_targets(names: Sequence[str]) -> dict[str, tuple[Any, str | None]]:
    """``{"ns::op": (OpOverload, overload named or None)}`` of the splitting ops that would decompose
    while lowering (the overload is the named one, else ``default``)."""
    found = {}
    for name in names:
        packet, overload_name = _lookup(name)
        overload = getattr(packet, overload_name or "default", None)
        if overload is not None and _is_composite(overload):
            found[packet._qualified_op_name] = (overload, overload_name)
    return found


def keep_composite_ops_whole(gm: fx.GraphModule, names: Sequence[str]) -> int:
    """Re-target calls of composite splitting ops in a Dynamo graph to their opaque twins.

    Matches by qualified name (namespace included): ``torch.ops`` targets (an ``OpOverload`` only
    when the name lists no overload or lists that one), and torch's builtin functions, which are
    aten ops (``F.scaled_dot_product_attention`` is ``torch._C._nn.scaled_dot_product_attention``,
    matched by ``aten::scaled_dot_product_attention`` only). Returns the number of calls re-targeted.
    """
    composite = _composite_targets(names)
    if not composite:
        return 0
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        overload = None
        if isinstance(target, torch._ops.OpOverload):
            wanted = composite.get(target._schema.name)
            if wanted is not None and wanted[1] in (None, target._overloadname) and _is_composite(target):
                overload = target
        elif isinstance(target, torch._ops.OpOverloadPacket):
            wanted = composite.get(target._qualified_op_name)
            overload = wanted[0] if wanted is not None else None
        elif type(target).__name__ == "builtin_function_or_method" and str(
            getattr(target, "__module__", "") or ""
        ).startswith("torch"):
            wanted = composite.get(f"aten::{getattr(target, '__name__', '')}")
            overload = wanted[0] if wanted is not None else None
        if overload is not None:
            node.target = _opaque_twin(overload)
            count += 1
    if count:
        gm.recompile()
    return count


# -- host arguments ----------------------------------------------------------------------------

_HOST: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "devgraph_host", default=None
)


def host_arg(name: str) -> list[Any]:
    """The host list ``name`` of the call being run (``[]`` while tracing or compiling)."""
    values = _HOST.get()
    if values is None:
        return []
    return list(values.get(name, []))


@contextlib.contextmanager
def host_values(values: Mapping[str, Any] | None) -> Iterator[None]:
    """Make ``values`` (``{op argument: host list}``) what ``host_arg`` returns in the block."""
    token = _HOST.set(values)
    try:
        yield
    finally:
        _HOST.reset(token)


def bind_host_args(gm: fx.GraphModule, op_args: Sequence[str]) -> list[fx.Node]:
    """Feed every op argument named in ``op_args`` from ``host_arg(name)`` at run time.

    Returns the ops that take a host argument. One ``host_arg`` node is made per use, right before
    its op, so the split can put it in the op's own partition.
    """
    wanted = set(op_args)
    if not wanted:
        return []
    users = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        hit = False
        args, kwargs = list(node.args), dict(node.kwargs)
        for i, arg in enumerate(schema.arguments):
            if arg.name not in wanted:
                continue
            with gm.graph.inserting_before(node):
                source = gm.graph.call_function(host_arg, (arg.name,))
            source.meta["val"] = []
            if i < len(args):
                args[i] = source
            else:
                kwargs[arg.name] = source
            hit = True
        if hit:
            node.args, node.kwargs = tuple(args), kwargs
            users.append(node)
    gm.recompile()
    return users


def is_host_arg_node(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is host_arg


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
