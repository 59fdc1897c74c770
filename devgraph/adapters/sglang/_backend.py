"""``DevgraphGraphBackend``: SGLang's graph-backend ABC implemented over ``devgraph.Graph``.

One graph per ``ShapeKey``, captured largest first (SGLang's runner orders the keys) into one pool
shared by every devgraph backend of the device, on devgraph's capture stream, after two warm-up
runs. Outputs are held by weak reference: the graph's pool owns their memory, so smaller buckets
reuse the largest one's blocks; a replay overwrites the previous outputs (SGLang slices and copies
them before the next step).

Host arguments: the captured decode attention is an updatable task (the device's
``updatable_ops``). Every replay hands it the batch's host lengths: from the attention backend's
``devgraph_host_args()`` (the ``devgraph`` attention backend) in ``replay``, or from the caller in
``replay_with_input_update`` (SGLang's NPU runner path, torch_npu's ``cpu_update_input`` shape).
Forgetting them replays the lengths frozen at capture; devgraph never does that silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from sglang.srt.model_executor.runner_backend.base_cuda_graph_backend import BaseCudaGraphBackend

import devgraph
from devgraph._errors import DevgraphError
from devgraph.adapters.sglang import _compare_eager, _stats
from devgraph.graph import Device, Graph, GraphSet, Replayable, SharedPool, holds_tensor

logger = logging.getLogger(__name__)

#: Eager runs before each capture: SGLang's own two on a device (lazy library initialisation, the
#: allocator's first blocks); one where the graph records ops while running them (the CPU reference
#: and the NPU simulator: the capture itself runs the forward), which shortens engine start.
WARMUP_RUNS = 2


def warmup_runs(device: Device) -> int:
    """How many eager runs precede a capture on ``device`` (see ``WARMUP_RUNS``)."""
    return 1 if device.torch_device.type == "cpu" else WARMUP_RUNS


"""Eager runs before each capture (SGLang's in-tree backends do two as well)."""


#: One ``SharedPool`` per devgraph device for every live devgraph backend (decode graphs share
#: memory); it renews its pool once every graph captured into it was reset.
SHARED_POOLS: dict[str, SharedPool] = {}


def shared_pool(device: Device) -> SharedPool:
    """The ``SharedPool`` every devgraph backend on ``device`` captures into."""
    return SHARED_POOLS.setdefault(str(device), SharedPool(device))


def devgraph_device_for(torch_device: str | torch.device) -> Device:
    """The devgraph device for SGLang's device string (``"cpu"``, ``"npu"``, ``"cuda:1"``).

    devgraph's chosen device (``devgraph.device()``: ``DEVGRAPH_BACKEND`` to force one) when its
    tensors live on that torch device, else the backend named by the device type. The chosen
    device can be another backend than the type's: devgraph's NPU backend on devgraph.testing's
    torch_npu simulator keeps its tensors on ``cpu``, so an engine on ``cpu`` captures NPU graphs.

    Raises:
        DevgraphError / BackendUnavailable: no devgraph backend serves that device here.
    """
    dev = torch.device(torch_device)
    index = dev.index or 0
    chosen = devgraph.device()
    if chosen.torch_device.type == dev.type and chosen.index == index:
        return chosen
    return devgraph.device(dev.type, index)


def _weak_outputs(out: Any) -> Any:
    """The capture output with every tensor replaced by a non-owning view (its memory is the pool's)."""
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        changes = {
            f.name: devgraph.weak_ref_tensors(getattr(out, f.name))
            for f in dataclasses.fields(out)
            if f.init and holds_tensor(getattr(out, f.name))
        }
        return dataclasses.replace(out, **changes)
    tensors = getattr(out, "tensors", None)
    if isinstance(tensors, dict):  # PPProxyTensors
        return type(out)(devgraph.weak_ref_tensors(tensors))
    return devgraph.weak_ref_tensors(out)


class GraphHolder:
    """What devgraph's SGLang graph backends share (decode: ``DevgraphGraphBackend``; prefill:
    ``_prefill.DevgraphBreakableBackend``): the devgraph device, the set of graphs by SGLang
    ``ShapeKey``, SGLang's capture session, and the session-less replay. devgraph captures on its
    device's one capture stream (captures are serialised per device), so SGLang's stream is unused."""

    _device: Device
    _graphs: GraphSet[Any, Any]
    _in_session: bool = False
    _inputs_keepalive: dict[Any, Any]

    @property
    def device(self) -> Device:
        """The devgraph device the graphs are captured on."""
        return self._device

    @property
    def graphs(self) -> Mapping[Any, Replayable]:
        """The captured graphs by SGLang ``ShapeKey`` (read-only view)."""
        return dict(self._graphs.items())

    def holds_graphs(self) -> bool:
        """True while any graph of this backend is captured."""
        return bool(self._graphs)

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        self._in_session = True
        try:
            yield
        finally:
            self._in_session = False

    def _require_session(self) -> None:
        if not self._in_session:
            raise DevgraphError("capture_one() outside capture_session(): SGLang's runner opens the session")

    def can_run(self, forward_batch: Any, shape_key: Any) -> bool:
        return shape_key in self._graphs

    @contextlib.contextmanager
    def replay_session(self) -> Iterator[None]:
        yield

    def cleanup(self) -> None:
        self._graphs.reset()
        self._inputs_keepalive = {}


class DevgraphGraphBackend(GraphHolder, BaseCudaGraphBackend):
    """Captures and replays SGLang's decode forward per shape with ``devgraph.Graph``.

    Constructed by SGLang (``resolve_decode_backend`` through the platform's
    ``get_full_graph_backend_cls``, or by ``DevgraphNPUGraphRunner``) with the runner and SGLang's
    keyword options; ``enable_memory_saver`` is refused (devgraph pools cannot be paused).
    """

    def __init__(self, cuda_graph_runner: Any, *, enable_memory_saver: bool = False, **_options: Any) -> None:
        if enable_memory_saver:
            raise DevgraphError(
                "devgraph's SGLang graph backend does not support --enable-memory-saver for graphs "
                "(its pools cannot be released and restored); turn the memory saver off."
            )
        self._runner = cuda_graph_runner
        self._device = devgraph_device_for(cuda_graph_runner.model_runner.device)
        self._graphs: GraphSet[Any, Any] = GraphSet(
            self._device, shared_pool(self._device), weaken=_weak_outputs
        )
        self._in_session = False
        self._inputs_keepalive: dict[Any, Any] = {}

    # -- BaseCudaGraphBackend -----------------------------------------------------------------

    def capture_one(
        self,
        shape_key: Any,
        forward_fn: Callable[[], Any],
        capture_inputs: Any = None,
        post_warmup_hook: Callable[[], None] | None = None,
    ) -> None:
        self._require_session()
        for _ in range(warmup_runs(self._device)):
            self._device.synchronize()
            self._barrier()
            forward_fn()
            if post_warmup_hook is not None:
                post_warmup_hook()
        if capture_inputs is not None:
            # The graph reads these by address: keep their owners alive as long as the graph.
            self._inputs_keepalive[shape_key] = capture_inputs
        start = time.perf_counter()
        self._graphs.capture(shape_key, lambda graph: forward_fn())
        graph = self._graphs.graph(shape_key)
        if _compare_eager.CHECK is not None:  # DEVGRAPH_COMPARE_EAGER: off by default
            _compare_eager.remember(self, shape_key, forward_fn)
        size = getattr(shape_key, "size", shape_key)
        info = {"graph": type(graph).__name__, "tasks": [group.op for group in graph.tasks]}

        def update(s: _stats.GraphStats) -> None:
            s.captured.append(size)
            s.graphs[size] = info

        _stats.record(update)
        logger.debug(
            "devgraph: captured %s on %s in %.3f s (%d updatable tasks)",
            shape_key,
            self._device,
            time.perf_counter() - start,
            len(graph.tasks),
        )

    def replay(self, shape_key: Any, static_forward_batch: Any, **kwargs: Any) -> Any:
        host_args = self._attention_host_args()
        return self._replay(shape_key, host_args)

    def replay_with_input_update(
        self,
        shape_key: Any,
        seq_lens: Any = None,
        attr_name: str | None = None,
        attr_type: Any = None,
        cpu_update_input: Sequence[Mapping[str, Any]] | None = None,
    ) -> Any:
        """Replay with new host arguments for the updatable tasks (SGLang's NPU backend signature).

        With devgraph's attention backend the graph's tasks are its decode attention, which takes
        its own argument names (``attr_name`` names an argument of SGLang's Ascend kernels, e.g.
        ``actual_seq_lengths_kv``): the lengths it set for this batch outside the graph are used,
        and the caller's are not. Otherwise ``cpu_update_input`` is torch_npu's shape: one mapping
        per updatable task in capture order, or a single mapping that every task taking those names
        receives (SGLang's NPU runner passes ``[{attr_name: seq_lens}]`` for all its attention
        layers); without it, ``{attr_name: seq_lens}`` is used. A tensor ``seq_lens`` is passed on
        as a host list.
        """
        own = self._attention_host_args()
        if own is not None:
            return self._replay(shape_key, own)
        if cpu_update_input is None:
            if attr_name is None:
                raise DevgraphError(
                    "replay_with_input_update needs attr_name with seq_lens, or cpu_update_input"
                )
            if isinstance(seq_lens, torch.Tensor):
                seq_lens = seq_lens.tolist()
            cpu_update_input = [{attr_name: list(seq_lens)}]
        return self._replay(shape_key, cpu_update_input)

    # -- internals ----------------------------------------------------------------------------

    def _replay(self, shape_key: Any, host_args: Any) -> Any:
        host_args = self._for_graph(self._graphs.graph(shape_key), host_args)
        output = self._graphs.replay(shape_key, host_args)
        self._count(shape_key, updated=host_args is not None)
        if _compare_eager.CHECK is not None:  # DEVGRAPH_COMPARE_EAGER: off by default
            _compare_eager.replayed(self, shape_key, output)
        return output

    @staticmethod
    def _for_graph(graph: Graph, host_args: Any) -> Any:
        """Host arguments in the form ``Graph.update`` takes for this graph (None: nothing to update)."""
        if not host_args or not graph.tasks:
            return None
        if isinstance(host_args, Mapping):
            return host_args
        host_args = list(host_args)
        if len(host_args) == 1 and len(graph.tasks) != 1:
            return host_args[0]  # one mapping for every task (SGLang's NPU runner)
        return host_args

    def _attention_host_args(self) -> Mapping[str, Any] | None:
        backend = getattr(self._runner, "attn_backend", None)
        get = getattr(backend, "devgraph_host_args", None)
        return get() if get is not None else None

    def _count(self, shape_key: Any, *, updated: bool) -> None:
        size = getattr(shape_key, "size", None)
        raw = getattr(self._runner, "raw_bs", None)
        padded = size - raw if isinstance(size, int) and isinstance(raw, int) and raw < size else 0

        def update(s: _stats.GraphStats) -> None:
            s.replays[size] += 1
            s.task_updates += int(updated)
            if padded:
                s.padded_replays += 1
                s.padded_rows += padded

        _stats.record(update)

    def _barrier(self) -> None:
        tp_barrier()


def tp_barrier() -> None:
    """Wait for every tensor-parallel rank (before each warm-up, as SGLang's backends do)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        group = get_parallel().tp_group
    except Exception:  # no parallel state (a runner built outside an engine): nothing to wait for
        return
    if group is not None and getattr(group, "world_size", 1) > 1:
        group.barrier()
