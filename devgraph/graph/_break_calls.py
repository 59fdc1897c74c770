"""A break of a breakable capture: the call held between two segment graphs and re-run at replay.

``CapturedBreak`` holds the op, its arguments (tensors the pool owns as non-owning views, the rest
as they are) and where its fresh results go (buffers the next segment reads); ``captured_break``
builds one; ``fake_result`` shapes a break's results before its segment ends (its fake impl);
``completed`` waits a functional collective's result. See ``_breakable``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from devgraph._errors import DevgraphError
from devgraph.graph._flat import tree_tensors

if TYPE_CHECKING:
    import torch

__all__ = ["CapturedBreak", "aliases", "captured_break", "completed", "fake_result", "storage", "tensors"]

logger = logging.getLogger("devgraph")


@attrs.define(eq=False)
class CapturedBreak:
    """One break of a breakable capture: the call re-run eagerly after segment ``index``.

    Attributes:
        index: the segment graph it follows (it runs before segment ``index + 1``).
        op: the op's name (``"devgraph::paged_decode_attention"``).
        host_args: its host (non-tensor) arguments by name, as captured.
        source: the user's line that called it.
    """

    index: int
    op: str
    host_args: dict[str, Any]
    source: str | None
    _func: Callable[..., Any] = attrs.field(repr=False)
    _args: list[Any] = attrs.field(repr=False)
    _kwargs: dict[str, Any] = attrs.field(repr=False)
    _slots: dict[str, tuple[int | None, str]] = attrs.field(repr=False)  # host name -> (position, kw)
    _outs: list[tuple[int, Any]] = attrs.field(factory=list, repr=False)  # (result leaf, its buffer)
    _wait: bool = attrs.field(default=False, repr=False)  # a functional collective: wait its result

    def takes(self, name: str) -> bool:
        """Whether the call has a host argument ``name`` (``replay(host_args)`` replaces it)."""
        return name in self._slots

    @property
    def call(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """The captured call ``(op, args, kwargs)``: pool tensors as non-owning views, host values
        as captured (for a loop of one's own over ``BreakableGraph.graphs``)."""
        return self._func, tuple(self._args), dict(self._kwargs)

    def run(self, host_args: Mapping[str, Any] | None) -> None:
        """Re-run the call (the names it takes in ``host_args`` replacing its host values; others are
        ignored) and write its fresh results into their capture-time buffers. The hot path of a
        replay: one per break per call."""
        args, kwargs = self._args, self._kwargs
        if host_args:
            slots = self._slots
            for name, value in host_args.items():
                slot = slots.get(name)
                if slot is None:
                    continue
                if args is self._args:  # copied once, on the first argument this call replaces
                    args, kwargs = list(args), dict(kwargs)
                position, keyword = slot
                if position is not None:
                    args[position] = value
                else:
                    kwargs[keyword] = value
        result = self._func(*args, **kwargs)
        if self._wait:
            result = completed(self.op, result)
        if self._outs:
            from torch.utils._pytree import tree_flatten

            leaves = tree_flatten(result)[0]
            for i, buffer in self._outs:
                if leaves[i].shape != buffer.shape:
                    raise DevgraphError(
                        f"break {self.op} returned shape {tuple(leaves[i].shape)} at replay, "
                        f"{tuple(buffer.shape)} at capture (at {self.source}); the graphs after it read "
                        "the capture-time shape. Replay only calls of the captured size."
                    )
                buffer.copy_(leaves[i])


_FUNCTIONAL_COLLECTIVES = "_c10d_functional::"


def completed(name: str, result: Any) -> Any:
    """``result``, waited first when it is a functional collective's (its tensors are only final after
    ``wait_tensor``, which eager code leaves to the first use; a break's result is copied at once)."""
    if not name.startswith(_FUNCTIONAL_COLLECTIVES):
        return result
    import torch
    from torch.utils._pytree import tree_map

    wait = torch.ops._c10d_functional.wait_tensor.default
    return tree_map(lambda t: wait(t) if isinstance(t, torch.Tensor) else t, result)


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors of ``tree`` (``tree_tensors``: containers registered with pytree included)."""
    return iter(tree_tensors(tree))


def storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage; 0 for a tensor with none (meta, fake, functional, sparse)."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    if t.device.type == "meta" or t.layout != torch.strided or is_fake(t):
        return 0
    try:
        return int(t.untyped_storage().data_ptr())
    except RuntimeError:  # a functional or other wrapper tensor
        return 0


def aliases(t: Any, inputs: set[int]) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and storage(t) in inputs


def fake_result(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's result computed by its fake impl (shapes, strides, dtypes), or None where it has
    none or returns no tensor."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    schema = getattr(func, "_schema", None)
    if schema is not None and not schema.returns:
        return None  # writes into what it is given (devgraph's attention ops: ``out``)
    try:
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with mode:
                result = func(*args, **kwargs)
    except Exception as exc:  # no fake impl, or one that reads values: keep the eager result instead
        logger.debug("devgraph: no fake result for break %r (%s); its eager result is kept", func, exc)
        return None
    return result if any(True for _ in tensors(result)) else None


def _arg_names(func: Any) -> list[str]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        overloads = getattr(func, "overloads", None)
        if overloads is not None and len(func.overloads()) == 1:
            schema = getattr(func, func.overloads()[0])._schema
    return [a.name for a in schema.arguments] if schema is not None else []


def captured_break(
    index: int,
    name: str,
    source: str | None,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    outs: list[tuple[int, Any]],
    keep: Callable[[Any], Any],
) -> CapturedBreak:
    from devgraph.graph._tasks import holds_tensor

    names = _arg_names(func)
    slots: dict[str, tuple[int | None, str]] = {}
    host: dict[str, Any] = {}
    for i, value in enumerate(args):
        if i < len(names) and value is not None and not holds_tensor(value):
            slots[names[i]] = (i, names[i])
            host[names[i]] = value
    for key, value in kwargs.items():
        if value is not None and not holds_tensor(value):
            slots[key] = (None, key)
            host[key] = value
    return CapturedBreak(
        index=index,
        op=name,
        host_args=host,
        source=source,
        func=func,
        args=[keep(a) for a in args],
        kwargs={k: keep(v) for k, v in kwargs.items()},
        slots=slots,
        outs=outs,
        wait=name.startswith(_FUNCTIONAL_COLLECTIVES),
    )
