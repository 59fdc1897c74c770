"""Qualified op names (``"namespace::op[.overload]"``): checked against ``torch.ops``, one message;
and what an op's schema says it does to its arguments (``is_view``, ``written_arguments``).

The compile layer's splitting ops and ``Graph.capture(auto_update_ops=...)`` both name ops this
way; both refuse a name that is misspelt or names no registered op, with the same message. The
recorder, the host-compute check, the bisect's probe and the fusion passes read an op's schema the
same way through the two schema helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from devgraph._errors import DevgraphError

__all__ = [
    "TORCH_NAMESPACES",
    "has_python_kernel",
    "is_view",
    "lookup_op",
    "resolve_auto_update_ops",
    "writes_arguments",
    "written_arguments",
    "written_tensors",
]


def is_view(schema: Any) -> bool:
    """Whether an op of this schema returns views of its arguments and writes none of them
    (``view``, ``slice``, ``split``: ``Tensor(a)``, ``Tensor(a)[]``)."""
    rets = schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def written_tensors(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The tensors op ``func`` writes among its arguments (``written_arguments``, flattened: an op's
    arguments are flat by schema)."""
    from devgraph.graph._flat import tensor_leaves

    return tensor_leaves(written_arguments(func._schema, args, kwargs))


def _writes(arg: Any) -> bool:
    return (arg.alias_info is not None and arg.alias_info.is_write) or arg.name == "out"


def writes_arguments(schema: Any) -> bool:
    """Whether an op of this schema writes any of its arguments (in place, ``out=``)."""
    return any(_writes(arg) for arg in schema.arguments)


def written_arguments(schema: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The argument values an op of this schema writes (``Tensor(a!)``, or an argument named ``out``),
    as passed: tensors at run time, fx nodes in a graph. Empty for an op that writes none."""
    written = []
    for i, arg in enumerate(schema.arguments):
        if _writes(arg):
            written.append(args[i] if i < len(args) else kwargs.get(arg.name))
    return written


_AUTO_UPDATE_SPELLING = (
    "spell auto_update_ops 'namespace::op', e.g. 'devgraph::paged_decode_attention'; an engine's custom "
    "op must be registered (its module imported) before capture"
)


def lookup_op(name: Any, role: str, spelling: str) -> tuple[Any, str | None]:
    """``(OpOverloadPacket, overload or None)`` for ``"ns::op[.overload]"``.

    Raises:
        DevgraphError: ``name`` is not qualified, or ``torch.ops`` has no such op or overload; the
            message names the ``role`` (``"splitting op"``) and ends with ``spelling``.
    """
    import torch

    if not isinstance(name, str) or "::" not in name:
        raise DevgraphError(f"{role} {name!r} is not a qualified op name: {spelling}")
    ns, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        raise DevgraphError(f"unknown {role} {name!r}: torch.ops.{ns} has no op {op!r}; {spelling}") from None
    if overload and overload not in packet.overloads():
        raise DevgraphError(
            f"unknown {role} {name!r}: {ns}::{op} has overloads {sorted(packet.overloads())}; {spelling}"
        )
    return packet, overload or None


def resolve_auto_update_ops(names: Sequence[str] | str, declared: Sequence[str] = ()) -> tuple[str, ...]:
    """``auto_update_ops`` as the ``"ns::op"`` names capture matches calls against, each checked.

    A name the device declares updatable (``declared``, its ``updatable_ops``) is taken as is, so a
    capture that never loads devgraph's ops still accepts them; any other must name a registered
    op. An overload spelling (``"aten::add.Tensor"``) stands for every call of the op.

    Raises:
        DevgraphError: a name that is not qualified or names no registered op.
    """
    if isinstance(names, str):
        names = (names,)
    resolved = []
    for name in names:
        if name not in declared:
            lookup_op(name, "auto-update op", _AUTO_UPDATE_SPELLING)
            ns, _, rest = name.partition("::")
            name = f"{ns}::{rest.partition('.')[0]}"  # capture matches the schema name
        resolved.append(name)
    return tuple(dict.fromkeys(resolved))


#: torch's own op namespaces (higher-order ops' included): their ops are torch's, never a user's.
TORCH_NAMESPACES = frozenset(
    {
        "aten",
        "prims",
        "prim",
        "rngprims",
        "c10d",
        "c10d_functional",
        "_c10d_functional",
        "_c10d_functional_autograd",
        "_dtensor",
        "inductor",
        "debug_mode_ops",
        "higher_order",
    }
)

# Namespaces whose Python kernels run whole (torch's own, and devgraph's ops, whose kernels are pure
# functions of their arguments, host arguments included, which task update changes). Any other op
# whose Python kernel torch itself defined (torch.library.custom_op in a ``torch.*`` module, such as
# ``_c10d_functional::_wrap_tensor_autograd``, which returns a tensor subclass) also runs whole.
_WHOLE_NAMESPACES = (TORCH_NAMESPACES - {"higher_order"}) | {"devgraph"}


def _defined_by_torch(qualname: str) -> bool:
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover - a torch without custom_op: only namespaces decide
        return False
    opdef = OPDEFS.get(qualname)
    module = getattr(getattr(opdef, "_init_fn", None), "__module__", "") or ""
    return module == "torch" or module.startswith("torch.")


_PYTHON_KERNELS: dict[tuple[Any, str], bool] = {}


def has_python_kernel(func: Any, dispatch_key: str) -> bool:
    """True for a custom op whose ``dispatch_key`` kernel is a Python function (``torch.library``).

    ``dispatch_key`` is the device's backend key (``"CPU"``, ``"CUDA"``, ``"PrivateUse1"``); a
    ``CompositeExplicitAutograd`` kernel (what ``torch.library.custom_op`` registers) serves every
    device. Such a body may read live Python state (vLLM's attention reads its forward context) and
    launches ops of its own, which a capture must see one by one: an updatable op among them is a
    task, and what the body read at capture is frozen, exactly as a device graph freezes it.
    """
    key = (func, dispatch_key)
    known = _PYTHON_KERNELS.get(key)
    if known is None:
        import torch

        ns, _, rest = func.name().partition("::")
        overload = func._overloadname
        name = rest if overload == "default" else f"{rest}.{overload}"
        registered: set[str] = getattr(torch.library, "_impls", set())
        known = _PYTHON_KERNELS[key] = (
            ns not in _WHOLE_NAMESPACES
            and not _defined_by_torch(f"{ns}::{rest}")
            and any(f"{ns}/{name}/{k}" in registered for k in (dispatch_key, "CompositeExplicitAutograd"))
        )
    return known
