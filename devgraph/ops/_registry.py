"""The op registry: one ``torch.library`` definition per devgraph op, kernels per dispatch key.

How a call reaches a kernel:

1. ``torch.ops.devgraph.<op>`` goes through the torch dispatcher, which picks a dispatch key from the
   tensors (``CPU``, ``CUDA``, ``PrivateUse1``...).
2. Under every key a backend provides, the registry has registered a *trampoline*, not the backend's
   kernel itself. The trampoline validates the arguments (the op's ``check``, the same one the fake
   impl runs) and calls ``kernel_for(op, key)``.
3. ``kernel_for`` looks the kernel up in the registry's table, after applying the routing of
   ``route(...)``.

That indirection is the simulation seam: the torch_npu simulator runs on CPU tensors, so the
dispatcher picks ``CPU``; inside ``with route(CPU="PrivateUse1"):`` those calls run the NPU
(``PrivateUse1``) kernels instead, host-list semantics and all. Nothing in torch is patched. The
routing is a ``contextvars`` variable, so it is per thread / per task.

Registration is idempotent: a definition, fake impl or trampoline already in the dispatcher is not
registered again (checked with ``torch._C._dispatch_has_kernel_for_dispatch_key``), so ``load()``
twice, or two engines loading devgraph's ops, is harmless; registering a kernel again replaces the
table entry. Backends contribute kernels through the plugin hook
``devgraph_register_op_kernels(register)``, which ``devgraph.ops.load()`` (``_load``) calls; the
registry itself knows no op: ``_defs`` defines them through ``define``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch

from devgraph._errors import DevgraphError

__all__ = [
    "NAMESPACE",
    "OpDef",
    "define",
    "has_kernel",
    "kernel_for",
    "op_names",
    "qualname",
    "register",
    "route",
]

logger = logging.getLogger("devgraph.ops")

NAMESPACE = "devgraph"


@attrs.frozen
class OpDef:
    """A devgraph op as defined: its schema, fake (meta) impl and argument check.

    Attributes:
        name: the op's name in the ``devgraph`` namespace (``"rms_norm"``).
        schema: the ``torch.library`` schema, name included.
        fake: shape/dtype-only impl used by tracing (``torch.compile``, ``make_fx``).
        check: raises ``ValueError`` on bad arguments; run before every kernel and by ``fake``.
    """

    name: str
    schema: str
    fake: Callable[..., Any]
    check: Callable[..., None] | None = None


_lock = threading.RLock()
_defs: dict[str, OpDef] = {}
_kernels: dict[tuple[str, str], Callable[..., Any]] = {}
_trampolines: set[tuple[str, str]] = set()
_route: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "devgraph_op_route", default=None
)
# A torch.library.Library deregisters everything it registered when it is garbage collected, so the
# one this module uses lives as long as the process.
_lib: torch.library.Library | None = None


def _library() -> torch.library.Library:
    global _lib
    if _lib is None:
        _lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    return _lib


def _short(op: str) -> str:
    prefix = NAMESPACE + "::"
    name = op[len(prefix) :] if op.startswith(prefix) else op
    return name.split(".")[0]  # "rms_norm.default" -> "rms_norm"


def qualname(op: str) -> str:
    """``"devgraph::<op>"`` for ``"<op>"`` or an already qualified name."""
    return f"{NAMESPACE}::{_short(op)}"


def _schema_exists(qual: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(qual, "")
    except RuntimeError:
        return False
    return True


def has_kernel(op: str, key: str) -> bool:
    """Whether the torch dispatcher has a kernel for ``devgraph::<op>`` under dispatch key ``key``.

    Asks the dispatcher itself, so it also sees registrations made by another copy of this module.
    """
    qual = qualname(op)
    return _schema_exists(qual) and torch._C._dispatch_has_kernel_for_dispatch_key(qual, key)


def op_names() -> tuple[str, ...]:
    """Names of the ops defined so far (``load()`` defines them all)."""
    with _lock:
        return tuple(sorted(_defs))


def define(
    name: str, schema: str, *, fake: Callable[..., Any], check: Callable[..., None] | None = None
) -> OpDef:
    """Define ``devgraph::<name>`` with ``schema`` and its fake impl (once per process).

    Calling it again is harmless: what the dispatcher already has is kept, the check is replaced.
    """
    qual = qualname(name)
    if not schema.startswith(name + "("):
        raise DevgraphError(f"schema of {qual} must start with '{name}(', got {schema!r}")
    op = OpDef(name, schema, fake, check)
    with _lock:
        _defs[name] = op
        if not _schema_exists(qual):
            _library().define(schema)
        # register_fake installs a Meta kernel; its presence means a fake impl is there already.
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qual, "Meta"):
            torch.library.register_fake(qual, fake, lib=_library())
    return op


def _this_module() -> Any:
    # Trampolines stay in the dispatcher for the life of the process. Should this module be imported
    # afresh (a test purging sys.modules), they must consult the live table, not a stale one.
    return sys.modules.get(__name__) or _self


def _trampoline(name: str, key: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        registry = _this_module()
        op = registry._defs.get(name)
        if op is not None and op.check is not None:
            op.check(*args, **kwargs)
        return registry.kernel_for(name, key)(*args, **kwargs)

    kernel.__name__ = f"devgraph_{name}_{key}_trampoline"
    kernel.__qualname__ = kernel.__name__
    return kernel


def register(op: str, key: str, kernel: Callable[..., Any]) -> None:
    """Make ``kernel`` the ``key`` kernel of devgraph op ``op`` (the hook's ``register``).

    ``op`` is ``"rms_norm"`` or ``"devgraph::rms_norm"``; ``key`` a torch dispatch key (``"CPU"``,
    ``"CUDA"``, ``"PrivateUse1"``). The kernel receives the op's arguments in schema order.

    Raises:
        DevgraphError: the op is not defined, or torch refuses the dispatch key.
    """
    if not callable(kernel):
        raise DevgraphError(f"kernel for {qualname(op)} under {key} is not callable: {kernel!r}")
    name = _short(op)
    with _lock:
        if name not in _defs:
            raise DevgraphError(
                f"cannot register a {key} kernel for unknown op {qualname(op)}; devgraph defines "
                f"{', '.join(op_names()) or 'no ops yet'} (devgraph.ops.load() defines them)"
            )
        _kernels[(name, key)] = kernel
        if (name, key) in _trampolines:
            return
        if has_kernel(name, key):
            # Registered by an earlier copy of this module (its trampoline reads our table) or by
            # someone else through torch.library directly: either way, do not override it.
            logger.debug("%s already has a %s kernel in the dispatcher; keeping it", qualname(name), key)
        else:
            try:
                _library().impl(name, _trampoline(name, key), key)
            except RuntimeError as exc:
                del _kernels[(name, key)]
                raise DevgraphError(f"torch refused a {key} kernel for {qualname(name)}: {exc}") from exc
        _trampolines.add((name, key))


def kernel_for(op: str, key: str) -> Callable[..., Any]:
    """The kernel a call of ``op`` dispatched under ``key`` runs, after ``route(...)`` redirection.

    Raises:
        DevgraphError: no backend registered a kernel for the (routed) key.
    """
    name = _short(op)
    routing = _route.get()
    target = routing.get(key, key) if routing else key
    kernel = _kernels.get((name, target))
    if kernel is not None:
        return kernel
    routed = (
        f" (calls on {key} tensors are routed to {target} by devgraph.ops.route)" if target != key else ""
    )
    have = sorted(k for n, k in _kernels if n == name)
    raise DevgraphError(
        f"{qualname(name)} has no {target} kernel{routed}; kernels are registered for "
        f"{', '.join(have) or 'no key'}. The backend for {target} provides it through the "
        "devgraph_register_op_kernels hook: is it installed? (devgraph.ops.load() re-collects kernels)"
    )


@contextlib.contextmanager
def route(**mapping: str) -> Iterator[None]:
    """Within the block, run calls dispatched under one key with another key's kernels.

    ``with route(CPU="PrivateUse1"):`` makes CPU-tensor calls run the NPU kernels (the torch_npu
    simulator's seam). Nested routes combine, the inner one winning per key.

    The routing is read when a call is dispatched. A graph that replays by dispatching its ops
    again (the CPU reference backend's recorder) must therefore replay inside the same ``route``.
    """
    for key, target in mapping.items():
        if not isinstance(target, str) or not target:
            raise DevgraphError(f"route({key}=...) needs a dispatch key name, got {target!r}")
    token = _route.set({**(_route.get() or {}), **mapping})
    try:
        yield
    finally:
        _route.reset(token)


_self = sys.modules[__name__]
