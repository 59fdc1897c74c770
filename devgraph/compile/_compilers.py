"""The compilers a piece can be compiled with: devgraph's own (eager, inductor) and those backends
contribute for their device through the ``devgraph_register_compilers(register, device)`` hook (the
NPU backend's ``torchair``).

devgraph calls them *compilers* (a "backend" in devgraph is a device plugin); the public option
that picks one, ``compile_backend=``, keeps torch's word (``torch.compile(backend=...)``).

A compiled piece is a callable over the piece's inputs plus a flag, ``opaque``: True when the
compiled code may launch kernels without going through the torch dispatcher (inductor's CPU
code does). Capture runs an opaque piece through ``Graph.call_opaque`` so that every backend can
capture it: stream capture (cuda, npu) records what it launches; the CPU reference backend records
it as one task replayed on the same tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from torch import fx

from devgraph._errors import DevgraphError

if TYPE_CHECKING:
    from devgraph.graph import Device

__all__ = ["BUILTIN_COMPILERS", "CompiledPiece", "Compiler", "compile_piece", "compilers_for"]

logger = logging.getLogger("devgraph.compile")


@attrs.frozen
class CompiledPiece:
    """A piece ready to run: ``fn(*inputs)``; ``opaque`` as in the module docstring."""

    fn: Callable[..., Any]
    compiler: str
    opaque: bool
    seconds: float = 0.0


def _eager(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    return gm


def _inductor(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    compiled: Any = compile_fx(gm, list(example_inputs))
    return compiled


#: A compiler: ``(compile_fn, opaque)``.
Compiler = tuple[Callable[..., Callable[..., Any]], bool]

#: devgraph's own compilers, on every device.
BUILTIN_COMPILERS: dict[str, Compiler] = {
    "eager": (_eager, False),
    "inductor": (_inductor, True),
}


def compilers_for(device: Device | None) -> dict[str, Compiler]:
    """Every compiler a piece can get on ``device``: the built-ins, then what backends contribute.

    Raises:
        DevgraphError: a plugin registers a name twice or a compile function that is not callable.
    """
    from devgraph._plugins import call_each_hookimpl, plugin_manager

    found = dict(BUILTIN_COMPILERS)
    if device is None:
        return found

    def register(name: str, compile_fn: Callable[..., Callable[..., Any]], opaque: bool = True) -> None:
        if not isinstance(name, str) or not callable(compile_fn):
            raise DevgraphError(
                f"devgraph_register_compilers registered ({name!r}, {compile_fn!r}); it takes a name and a "
                "compile function compile_fn(graph_module, example_inputs) -> callable"
            )
        if name in found:
            raise DevgraphError(f"compiler {name!r} is registered twice for {device.name}")
        found[name] = (compile_fn, bool(opaque))

    call_each_hookimpl(
        plugin_manager().hook.devgraph_register_compilers,
        "registering compilers",
        lambda origin: {"register": register, "device": device},
    )
    return found


def compile_piece(
    compiler: str,
    name: str,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    device: Device | None = None,
) -> CompiledPiece:
    """Compile piece ``name`` with ``compiler`` (one of ``compilers_for(device)``) for fake
    ``example_inputs`` (symbolic sizes kept).

    Raises:
        DevgraphError: a compiler this device does not have (the message lists those it has), or
            one that cannot run here.
    """
    available = compilers_for(device)
    if compiler not in available:
        where = f" on {device.name}" if device is not None else ""
        raise DevgraphError(
            f"unknown compile_backend {compiler!r}{where}; choose one of {sorted(available)} "
            "(backends add their device's compilers: torchair with the npu backend)"
        )
    compile_fn, opaque = available[compiler]
    start = time.perf_counter()
    fn = compile_fn(gm, example_inputs)
    seconds = time.perf_counter() - start
    if compiler != "eager":
        logger.debug("devgraph: compiled %s with %s in %.2f s", name, compiler, seconds)
    return CompiledPiece(fn, compiler, opaque, seconds)
