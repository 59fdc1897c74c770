"""``GraphSet``: graphs by key in one shared pool, the core every holder of graphs is built on.

Four holders keep graphs: the runner (one graph per bucket), the pieces of a split model (one per
piece and size), vLLM's graph wrapper (one per batch descriptor) and SGLang's graph backend (one
per shape key). Each needs the same four things, and gets them here:

* graphs by key, captured on one stream into one pool (capture the largest key first, so smaller
  graphs reuse its blocks; CUDA's allocator reuses a pool's freed blocks only on the stream that
  allocated them);
* outputs held by weak reference: the pool owns their memory, so the next (smaller) capture can
  reuse it, and a replay overwrites them;
* the pool renewed once all its graphs were reset (``SharedPool``): a retired pool is never captured
  into again;
* replay with host arguments (``Graph.replay(host_args)``: task update where the backend needs it).

A new engine adapter gets its graph core by holding one ``GraphSet``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Generic, Protocol, TypeVar, overload

from devgraph._errors import DevgraphError
from devgraph.graph._contract import Device, Graph, MemoryPool, Stream
from devgraph.graph._weakref import weak_ref_tensors

__all__ = ["GraphSet", "Replayable", "SharedPool"]

K = TypeVar("K", bound=Hashable)


class Replayable(Protocol):
    """What a ``GraphSet`` holds: captured once, replayed with host arguments, reset. ``Graph``
    (one recording) and ``BreakableGraph`` (segment graphs cut at break ops that run eagerly
    between them) both are; a holder of either is the same code with another ``make``."""

    def capture(
        self,
        stream: Stream | None = None,
        pool: MemoryPool | None = None,
        *,
        auto_update_ops: Sequence[str] = (),
    ) -> AbstractContextManager[Any]: ...

    def replay(self, host_args: Any = None) -> None: ...

    def reset(self) -> None: ...

    def is_captured(self) -> bool: ...


G = TypeVar("G", bound=Replayable)


class SharedPool:
    """One memory pool (and optionally one stream) for every graph set that captures into it.

    ``pool`` is renewed when the current one is retired (every graph that captured into it was reset
    or freed): CUDA's allocator asserts on a capture into such a pool, so every backend refuses it.
    ``make`` mints a pool (default ``device.pool()``; vLLM's adapter passes its platform's).

    Args:
        device: the device the graphs are captured on.
        stream: the stream every capture uses (None: the device's one capture stream).
        make: how to mint a fresh pool.
    """

    def __init__(
        self,
        device: Device,
        *,
        stream: Stream | None = None,
        make: Callable[[], MemoryPool] | None = None,
    ) -> None:
        self.device = device
        self.stream = stream
        self._make = make or device.pool
        self._pool: MemoryPool | None = None

    @property
    def pool(self) -> MemoryPool:
        """The pool to capture into now (a fresh one when none is held or the last one retired)."""
        if self._pool is None or self._pool.retired:
            self._pool = self._make()
        return self._pool

    @property
    def current(self) -> MemoryPool | None:
        """The pool held now, retired or not (None before the first ``pool``); renews nothing."""
        return self._pool

    def adopt(self, pool: MemoryPool) -> None:
        """Capture into ``pool`` from now on (until it retires)."""
        if pool.device.name != self.device.name:
            raise DevgraphError(f"pool belongs to {pool.device}, this shared pool to {self.device}")
        self._pool = pool


class GraphSet(Generic[K, G]):
    """Graphs by key, captured into one shared pool, outputs held weakly, replayed with host arguments.

    Args:
        device: the device to capture on.
        shared: the pool (and stream) to capture into, possibly shared with other graph sets;
            None: a ``SharedPool`` of this set's own on the device's capture stream.
        weaken: how a capture's output is held (default: every tensor a weak reference,
            ``weak_ref_tensors``); pass one for outputs that are not plain containers of tensors.
        make: how a graph is made (default ``device.graph()``): any ``Replayable``; breakable
            captures make ``BreakableGraph``s (``GraphSet[K, BreakableGraph]``).
    """

    @overload
    def __init__(
        self: GraphSet[K, Graph],
        device: Device,
        shared: SharedPool | None = None,
        *,
        weaken: Callable[[Any], Any] = weak_ref_tensors,
        make: None = None,
    ) -> None: ...

    @overload
    def __init__(
        self,
        device: Device,
        shared: SharedPool | None = None,
        *,
        weaken: Callable[[Any], Any] = weak_ref_tensors,
        make: Callable[[], G],
    ) -> None: ...

    def __init__(
        self,
        device: Device,
        shared: SharedPool | None = None,
        *,
        weaken: Callable[[Any], Any] = weak_ref_tensors,
        make: Callable[[], Any] | None = None,
    ) -> None:
        self.device = device
        self._make: Callable[[], Any] = make or device.graph  # G: the overloads say which
        self.shared = shared if shared is not None else SharedPool(device)
        self._weaken = weaken
        self._graphs: dict[K, G] = {}
        self._outputs: dict[K, Any] = {}

    # -- capture -------------------------------------------------------------------------------

    def capture(
        self,
        key: K,
        body: Callable[[G], Any],
        *,
        stream: Stream | None = None,
        auto_update_ops: Sequence[str] | None = None,
    ) -> Any:
        """Capture ``body(graph)`` as the graph of ``key``; return its output (the strong tensors).

        The output is kept weakly (``weaken``) and handed back by every ``replay(key)``. On any error
        nothing is kept and the graph lets go of the pool. ``auto_update_ops``: the ops captured as
        updatable tasks (default: the device's ``updatable_ops``; an engine adapter adds its own).

        Raises:
            DevgraphError: ``key`` is captured already (``discard`` or ``reset`` first).
            CaptureError: what the capture refused.
        """
        if key in self._graphs:
            raise DevgraphError(f"a graph for {key!r} is captured already; discard it or reset() first")
        graph = self._make()
        with graph.capture(
            stream=stream or self.shared.stream,
            pool=self.shared.pool,
            auto_update_ops=(
                getattr(self.device, "updatable_ops", ()) if auto_update_ops is None else auto_update_ops
            ),
        ):
            out = body(graph)
        self._graphs[key] = graph
        self._outputs[key] = self._weaken(out)
        return out

    # -- replay --------------------------------------------------------------------------------

    def replay(self, key: K, host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None) -> Any:
        """Replay the graph of ``key`` (with ``host_args``: its updatable tasks get them first) and
        return the outputs captured for it (overwritten by the next replay)."""
        self._graphs[key].replay(host_args)
        return self._outputs[key]

    # -- what is held --------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def __iter__(self) -> Iterator[K]:
        return iter(self._graphs)

    def __bool__(self) -> bool:
        return bool(self._graphs)

    def graph(self, key: K) -> G:
        """The graph of ``key``.

        Raises:
            DevgraphError: nothing captured for ``key`` (the message lists what is).
        """
        graph = self._graphs.get(key)
        if graph is None:
            raise DevgraphError(f"no graph for {key!r}; captured: {sorted(map(repr, self._graphs))}")
        return graph

    def output(self, key: K) -> Any:
        """The (weakly held) outputs captured for ``key``."""
        return self._outputs[key]

    def items(self) -> Iterator[tuple[K, G]]:
        return iter(list(self._graphs.items()))

    def outputs(self) -> dict[K, Any]:
        """Every key's (weakly held) outputs."""
        return dict(self._outputs)

    # -- letting go ----------------------------------------------------------------------------

    def discard(self, key: K) -> None:
        """Reset and forget the graph of ``key`` (nothing when there is none)."""
        graph = self._graphs.pop(key, None)
        self._outputs.pop(key, None)
        if graph is not None:
            graph.reset()

    def reset(self) -> None:
        """Reset and forget every graph (the shared pool renews itself once no graph holds it)."""
        graphs = list(self._graphs.values())
        self._graphs.clear()
        self._outputs.clear()
        for graph in graphs:
            graph.reset()
