"""The hooks a devgraph plugin can implement (project name ``devgraph``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from devgraph.graph import Device

hookspec = pluggy.HookspecMarker("devgraph")
hookimpl = pluggy.HookimplMarker("devgraph")

__all__ = ["hookimpl", "hookspec"]


@hookspec
def devgraph_register_backends(register: Callable[[Any], None]) -> None:
    """Register backends: call ``register(devgraph.BackendSpec(...))`` once per backend."""


@hookspec
def devgraph_register_op_kernels(register: Callable[[str, str, Callable[..., Any]], None]) -> None:
    """Register op kernels: ``register(op_name, dispatch_key, kernel)``.

    ``op_name`` is a devgraph op (``"rms_norm"``), ``dispatch_key`` a torch dispatch key
    (``"CPU"``, ``"CUDA"``, ``"PrivateUse1"``). Kernels are registered with ``torch.library``.
    """


@hookspec
def devgraph_register_passes(register: Callable[[Any], None], device: Device) -> None:
    """Contribute graph passes for ``device``: ``register(pass_instance)``."""


@hookspec
def devgraph_register_compilers(register: Callable[..., None], device: Device) -> None:
    """Contribute compilers of pieces for ``device``: ``register(name, compile_fn, opaque=True)``.

    ``compile_fn(graph_module, example_inputs)`` returns a callable over the piece's inputs;
    ``opaque``: the compiled code may launch kernels without going through the torch dispatcher (it
    is then captured through ``Graph.call_opaque``). ``eager`` and ``inductor`` are devgraph's own;
    a backend adds the compilers of its device (the NPU backend: ``torchair``).
    """


@hookspec
def devgraph_register_break_ops(register: Callable[..., None], device: Device | None) -> None:
    """Contribute break ops for ``device`` (None: any device): ``register("namespace::op", ...)``.

    A breakable capture on ``device`` runs every call of these ops eagerly between its segment
    graphs (``devgraph.graph.BreakableGraph``), e.g. collectives this backend cannot capture.
    """
