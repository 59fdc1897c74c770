"""The compilers a piece can be compiled with: eager, inductor, torchair.

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
from typing import Any

import attrs
from torch import fx

from devgraph._errors import DevgraphError

__all__ = ["CompiledPiece", "compile_piece"]

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


def _torchair(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    try:
        import torchair  # type: ignore[import-not-found]
    except ImportError as exc:
        raise DevgraphError(
            f"compile_backend='torchair' needs torchair, which cannot be imported here ({exc}); it ships "
            "with torch_npu (or `pip install torchair`) and needs an Ascend NPU. Use compile_backend='eager' "
            "to run the pieces uncompiled."
        ) from None
    # Every piece is captured into (and replayed from) an ACL graph. No torchair mode runs inside a
    # capture it does not own: max-autotune runs a GE graph through GE's executor, reduce-overhead and
    # npugraph_ex capture ACL graphs of their own; vllm-ascend treats torchair graph mode and ACL graph
    # capture as exclusive. Refuse instead of failing (or mis-capturing) on hardware.
    raise DevgraphError(
        f"compile_backend='torchair' (torchair {getattr(torchair, '__version__', '?')}) cannot compile "
        "pieces that devgraph captures into ACL graphs: none of torchair's modes (max-autotune, "
        "reduce-overhead, npugraph_ex) may run inside another capture. Use compile_backend='eager' "
        "(the npu default), or run the model under torchair alone, without devgraph's graphs"
    )


_COMPILERS: dict[str, tuple[Callable[..., Callable[..., Any]], bool]] = {
    "eager": (_eager, False),
    "inductor": (_inductor, True),
    "torchair": (_torchair, True),
}


def compile_piece(
    compiler: str, name: str, gm: fx.GraphModule, example_inputs: Sequence[Any]
) -> CompiledPiece:
    """Compile piece ``name`` with ``compiler`` for fake ``example_inputs`` (symbolic sizes kept).

    Raises:
        DevgraphError: an unknown compiler, or one that cannot run here (torchair without torch_npu).
    """
    if compiler not in _COMPILERS:
        raise DevgraphError(f"unknown compile_backend {compiler!r}; choose one of {sorted(_COMPILERS)}")
    compile_fn, opaque = _COMPILERS[compiler]
    start = time.perf_counter()
    fn = compile_fn(gm, example_inputs)
    seconds = time.perf_counter() - start
    if compiler != "eager":
        logger.debug("devgraph: compiled %s with %s in %.2f s", name, compiler, seconds)
    return CompiledPiece(fn, compiler, opaque, seconds)
