"""Break ops: the ops a breakable capture runs eagerly between its segment graphs.

Three sources, in this order: devgraph's attention ops (``ATTENTION_OPS``: they read per-call host
lengths on cpu and npu), the ops a user marks (``mark_break``, process-wide), and the ops plugins
contribute for a device through the ``devgraph_register_break_ops(register, device)`` hook (a
backend whose collectives cannot be captured registers them there, e.g.
``"_c10d_functional::all_reduce"``). Names are spelt ``"namespace::op"`` (an overload spelling,
``"ns::op.default"``, stands for every call of the op) and checked against ``torch.ops``.

Importing this module imports no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from devgraph._errors import DevgraphError
from devgraph.graph._opnames import lookup_op

if TYPE_CHECKING:
    from devgraph.graph._contract import Device

__all__ = [
    "ATTENTION_OPS",
    "add_break_source",
    "break_names",
    "break_ops",
    "call_name",
    "mark_break",
    "marked_breaks",
    "unmark_break",
]

#: devgraph's attention ops: breaks by default (their host lengths change every call).
ATTENTION_OPS = ("devgraph::paged_decode_attention",)

_SPELLING = (
    "spell a break op 'namespace::op', e.g. 'devgraph::paged_decode_attention' or "
    "'aten::scaled_dot_product_attention', or pass the op itself (torch.ops.ns.op); an engine's custom op "
    "must be registered (its module imported) first"
)

_lock = threading.Lock()
_marked: dict[str, None] = {}  # insertion-ordered set


def _name_of(op: Any) -> str:
    """``"ns::op"`` for a name, an ``OpOverload``, an ``OpOverloadPacket`` or a ``custom_op`` object."""
    if isinstance(op, str):
        if op in ATTENTION_OPS:
            return op  # devgraph's own: accepted before devgraph.ops defines them
        lookup_op(op, "break op", _SPELLING)
        ns, _, rest = op.partition("::")
        return f"{ns}::{rest.partition('.')[0]}"
    import torch

    op = getattr(op, "_opoverload", op)  # torch.library.custom_op's CustomOpDef
    if isinstance(op, torch._ops.OpOverload):
        return str(op._schema.name)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return str(op._qualified_op_name)
    raise DevgraphError(f"break op {op!r} is not an op: {_SPELLING}")


def break_names(ops: Any) -> tuple[str, ...]:
    """``ops`` (one op or name, or a sequence of them) as checked ``"ns::op"`` names, de-duplicated.

    Raises:
        DevgraphError: a name that is not qualified or names no registered op, or a non-op.
    """
    if isinstance(ops, str) or not isinstance(ops, (list, tuple, set, frozenset)):
        ops = (ops,)
    return tuple(dict.fromkeys(_name_of(op) for op in ops))


def mark_break(*ops: Any) -> None:
    """Make every call of ``ops`` a break in breakable captures from now on (process-wide).

    Each op is a name ``"namespace::op"`` or the op itself (``torch.ops.mylib.attn``, a
    ``torch.library.custom_op``). Marking an op twice is harmless.

    Raises:
        DevgraphError: a name that is not qualified or names no registered op.
    """
    names = [_name_of(op) for op in ops]  # all checked before any is marked
    with _lock:
        for name in names:
            _marked[name] = None


def unmark_break(*ops: Any) -> None:
    """Undo ``mark_break`` for ``ops`` (devgraph's attention ops stay breaks by default)."""
    names = [_name_of(op) for op in ops]
    with _lock:
        for name in names:
            _marked.pop(name, None)


def marked_breaks() -> tuple[str, ...]:
    """The ops ``mark_break`` made breaks, in marking order."""
    with _lock:
        return tuple(_marked)


#: Where contributed break ops come from: ``devgraph._plugins`` adds the plugin hook
#: ``devgraph_register_break_ops`` when it is imported (the graph layer does not import the plugin
#: machinery, which names the contract's types).
_sources: list[Callable[[Device | None], Iterable[Any]]] = []


def add_break_source(source: Callable[[Device | None], Iterable[Any]]) -> None:
    """Let ``source(device)`` contribute break ops (names or ops) to every ``break_ops(device)``."""
    if source not in _sources:
        _sources.append(source)


def _contributed(device: Device | None) -> list[str]:
    return [_name_of(op) for source in list(_sources) for op in source(device)]


def break_ops(device: Device | None = None, extra: Iterable[Any] = ()) -> tuple[str, ...]:
    """The break ops of a breakable capture on ``device``: devgraph's attention ops, the marked
    ops, the ops plugins contribute for ``device``, then ``extra`` (names or ops), de-duplicated.

    Raises:
        DevgraphError: a name in ``extra`` (or from a plugin) that names no registered op.
        PluginLoadError: a plugin's hook failed.
    """
    names = [*ATTENTION_OPS, *marked_breaks(), *_contributed(device), *(_name_of(op) for op in extra)]
    return tuple(dict.fromkeys(names))


def call_name(func: Any) -> str | None:
    """The ``"ns::op"`` a Python-level torch call is a call of, or None.

    ``torch.ops`` calls name their op; a torch function (``torch.nn.functional.scaled_dot_product_attention``,
    ``torch.matmul``, a ``Tensor`` method) is named ``"aten::<its name>"``: torch's Python bindings
    are named after the aten op they call.
    """
    schema = getattr(func, "_schema", None)
    if schema is not None and hasattr(schema, "name"):
        return str(schema.name)
    qualified = getattr(func, "_qualified_op_name", None)
    if isinstance(qualified, str):
        return qualified
    name = getattr(func, "__name__", None)
    return f"aten::{name}" if isinstance(name, str) else None
