"""What every backend's capture shares: the host-sync check and auto task groups.

A captured graph replays device work only; anything that needs the host to look at a device value
(``.item()``, ``.tolist()``, ``.cpu()``, data-dependent shapes) cannot be recorded. CUDA fails such
calls with "operation not permitted when stream is capturing"; devgraph refuses them *before* they
reach the device, on every backend, with a ``CaptureError`` naming the op, the user's line and a
remedy.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from devgraph._errors import CaptureError
from devgraph._source import user_source_line
from devgraph.graph._collectives import is_collective, refuse_collective, refuse_object_collective
from devgraph.graph._compiled_regions import CompiledRegions, op_recorders
from devgraph.graph._host_compute import for_capture as host_compute_for
from devgraph.graph._opnames import has_python_kernel
from devgraph.graph._tasks import TaskGroup

if TYPE_CHECKING:  # torch is imported when first needed
    import torch
    from torch._ops import OpOverload

__all__ = [
    "CheckedGraph",
    "refuse_unrecorded",
    "capturing",
    "dispatch_refusal",
    "host_sync_check",
    "op_check",
    "raise_refusal",
    "refuse_autocast_cache",
]

#: A check every op a capture's dispatch mode sees passes first, top-level calls and what Python-bodied
#: custom ops launch alike (a breakable capture sets one for its segments; see ``_breakable``). It
#: raises ``CaptureError`` to refuse an op.
op_check: contextvars.ContextVar[Callable[[Any, tuple[Any, ...], dict[str, Any]], None] | None] = (
    contextvars.ContextVar("devgraph_op_check", default=None)
)


class CaptureDevice(Protocol):
    """What the check uses of the graph's device (``devgraph.Device`` is one)."""

    @property
    def torch_device(self) -> torch.device: ...


class CheckedGraph(Protocol):
    """What the check uses of the graph it checks (``devgraph.Graph`` is one).

    The check needs the device type (which tensors the capture owns), whether an explicit task
    group is open, and a way to capture one call as an auto task; the graph drives the check, so
    the check names this much of it rather than importing the contract.
    """

    @property
    def device(self) -> CaptureDevice: ...

    _open_group: TaskGroup | None

    @property
    def tasks(self) -> Sequence[TaskGroup]: ...

    def _group(self, group: TaskGroup) -> AbstractContextManager[TaskGroup]: ...

    def _prepare_task_call(
        self, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[OpOverload, tuple[Any, ...], dict[str, Any], Callable[[Any], Any] | None]: ...

    def _updatable_tensor_args(self, func: OpOverload) -> tuple[str, ...]: ...


_SYNC_REMEDY = (
    "keep the value on the device (tensor ops instead of Python numbers), or compute it before "
    "capture and pass it in as a host argument of an updatable task (auto_update_ops)"
)
SHAPE_REMEDY = (
    "data-dependent output shapes cannot be captured: use a fixed-size form (masks, torch.where) "
    "or run this op eagerly (piecewise mode with splitting_ops=[...])"
)
_COPY_REMEDY = "move device-to-host copies out of the captured region (do them after replay)"

_READ_REMEDY = (
    "do not print or convert device tensors inside the captured region: the graph would not redo it at "
    "replay; read the outputs after replay (log shapes and dtypes, which are host metadata, if you need to)"
)

#: Tensor methods that make the host wait for a device value (refused only on the capturing device's
#: tensors: a CPU tensor inside a CUDA capture is host memory, and reading it is no sync).
FUNCTION_SYNCS = {
    "item": _SYNC_REMEDY,
    "tolist": _SYNC_REMEDY,
    "numpy": _COPY_REMEDY,
    "cpu": _COPY_REMEDY,
    "__bool__": _SYNC_REMEDY,
    "__int__": _SYNC_REMEDY,
    "__float__": _SYNC_REMEDY,
    "__index__": _SYNC_REMEDY,
    "__complex__": _SYNC_REMEDY,
    "__contains__": _SYNC_REMEDY,
    "__repr__": _READ_REMEDY,  # print(t), repr(t), f"{t}", logging of a tensor's values
    "__str__": _READ_REMEDY,
    "__format__": _READ_REMEDY,
    "__array__": _COPY_REMEDY,  # numpy.asarray(t)
}

#: aten ops that sync with the host or produce data-dependent shapes (besides those torch tags
#: ``data_dependent_output`` / ``dynamic_output_shape``: see ``dispatch_refusal``).
_DISPATCH_SYNCS = {
    "aten::_local_scalar_dense": _SYNC_REMEDY,
    "aten::is_nonzero": _SYNC_REMEDY,
    "aten::equal": _SYNC_REMEDY,
    "aten::allclose": _SYNC_REMEDY,
    # linalg's error checks read the info tensor on the host (CUDA syncs there): use the _ex variants.
    "aten::_linalg_check_errors": "use the torch.linalg.*_ex variant (inv_ex, cholesky_ex, ...) and "
    "check its info output after replay",
    "aten::nonzero": SHAPE_REMEDY,
    "aten::nonzero_static": "",  # fixed size: allowed
    "aten::masked_select": SHAPE_REMEDY,
    "aten::unique_dim": SHAPE_REMEDY,
    "aten::_unique2": SHAPE_REMEDY,
    "aten::unique_consecutive": SHAPE_REMEDY,
    "aten::unique_dim_consecutive": SHAPE_REMEDY,
}

_SPLIT_REMEDY = "pass the split points as a Python list (host values fixed at capture), not a tensor"
_BOOL_INDEX = "boolean-mask indexing has a data-dependent shape: " + SHAPE_REMEDY


def _has_mask(indices: Any) -> bool:
    import torch

    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


def dispatch_refusal(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The remedy when aten op ``func`` on these arguments cannot be captured, else None.

    An op is refused when it makes the host read a device value, or when the shape of its result
    depends on the values of its inputs (a graph replays fixed shapes). The general rule is torch's
    own: ops tagged ``data_dependent_output`` or ``dynamic_output_shape`` (the tags FakeTensor relies
    on to know it cannot infer a shape); the few tagged ops whose shape is fixed for some arguments
    (indexing with integer indices, ``repeat_interleave`` given ``output_size``) are refused only
    for the others.
    """
    import torch

    name = func._schema.name
    remedy = _DISPATCH_SYNCS.get(name)
    if remedy is not None:
        return remedy or None
    tags = func.tags
    if torch.Tag.data_dependent_output in tags:
        return _SYNC_REMEDY
    if name == "aten::index":
        return _BOOL_INDEX if _has_mask(args[1] if len(args) > 1 else kwargs.get("indices")) else None
    if name in ("aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        # x[mask] = values: fine for one broadcast value; values that match the mask's count do not.
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        values = args[2] if len(args) > 2 else kwargs.get("values")
        if _has_mask(indices) and isinstance(values, torch.Tensor) and values.numel() != 1:
            return _BOOL_INDEX
        return None
    if name == "aten::repeat_interleave" and kwargs.get("output_size") is not None:
        return None
    if name == "aten::one_hot" and (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) != -1:
        return None
    if torch.Tag.dynamic_output_shape in tags:
        return SHAPE_REMEDY
    return None


def _on_device(tree: Any, device_type: str) -> bool:
    """True when some tensor in ``tree`` is on ``device_type`` (what the captured device owns)."""
    import torch
    from torch.utils._pytree import tree_flatten

    return any(isinstance(t, torch.Tensor) and t.device.type == device_type for t in tree_flatten(tree)[0])


def raise_refusal(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise ``CaptureError`` if aten op ``func`` cannot be captured (see ``dispatch_refusal``).

    For recorders that see ops the capture check does not (what a composite op decomposes into).
    """
    remedy = dispatch_refusal(func, args, kwargs)
    if remedy:
        _raise_sync(func._schema.name, remedy)


def _raise_sync(op: str, remedy: str) -> None:
    # An object collective (all_gather_object...) reaches here through the host syncs it makes:
    # name the collective, not the sync.
    refuse_object_collective(user_source_line)
    if remedy in (SHAPE_REMEDY, _BOOL_INDEX, _SPLIT_REMEDY):
        what = (
            "data-dependent output shape inside graph capture: a graph replays the shapes it was "
            "captured with, whatever the new values"
        )
    elif remedy == _READ_REMEDY:
        what = "reading a device tensor's values on the host inside graph capture (the device would sync)"
    else:
        what = (
            "host synchronisation inside graph capture: the host cannot read device values while a "
            "graph is being recorded"
        )
    raise CaptureError(
        what,
        op=op,
        source=user_source_line(),
        remedy=remedy,
    )


def _modes() -> tuple[type, type]:
    """Build the mode classes lazily so ``import devgraph`` does not import torch's mode machinery:
    the host-sync check (a function mode) and the capture's dispatch mode."""
    return _host_sync_check(), _capture_dispatch_mode()


def _host_sync_check() -> type:
    """``HostSyncCheck``: refuses, at the torch function level, what a capture cannot record (a host
    read of a device value, a pageable upload, host data copied to the device) and what a recording
    backend would not see."""
    import torch
    from torch.overrides import TorchFunctionMode

    host_data_factories = {torch.tensor, torch.as_tensor}

    class HostSyncCheck(TorchFunctionMode):
        def __init__(self, device_type: str) -> None:
            super().__init__()
            self.device_type = device_type
            # The capture's dispatch mode, where the backend records what it sees (the CPU
            # reference): an op whose kernel reaches it with nothing is invisible to the recording.
            self.recording: Any = None
            self.recorders: list[Any] = []  # the backend's op recorders (their records_whole)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if torch.compiler.is_compiling():
                # Dynamo is tracing this mode into a compiled graph: stay out of the trace (a host
                # sync there breaks the graph, and the eager remainder comes back through here).
                return func(*args, **kwargs)
            name = getattr(func, "__name__", "")
            remedy = FUNCTION_SYNCS.get(name)
            if (
                remedy is not None
                and args
                and _is_tensor_method(func)
                and isinstance(args[0], torch.Tensor)
                and args[0].device.type == self.device_type
            ):
                _raise_sync(f"Tensor.{name}", remedy)
            if name == "to" and args and _moves_to_host(args, kwargs):
                _raise_sync("Tensor.to(cpu)", _COPY_REMEDY)
            if _pageable_upload(name, args, kwargs, self.device_type):
                refuse_object_collective(user_source_line)
                raise CaptureError(
                    "a pageable host tensor copied to the device inside graph capture: CUDA refuses "
                    "it, and the graph would replay the values of capture time",
                    op=f"Tensor.{name}",
                    source=user_source_line(),
                    remedy="copy into a device buffer before capture (and copy new values into it "
                    "before each replay), or use a pinned host tensor kept alive while the graph is "
                    "replayed",
                )
            if name == "tensor_split" and _on_device(
                (args[1:2], kwargs.get("indices_or_sections")), self.device_type
            ):
                # The split points are read on the host (in C++, no op to see below): frozen shapes.
                _raise_sync("torch.tensor_split", _SPLIT_REMEDY)
            recording = self.recording
            if (
                recording is not None
                and isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
                # a compiled graph or an opaque call is recorded whole: its replay runs every
                # kernel in it, seen or not
                and not any(getattr(r, "records_whole", False) for r in self.recorders)
            ):
                seen = recording.seen
                result = func(*args, **kwargs)
                if recording.seen == seen:
                    refuse_unrecorded(func, args, kwargs)
                return result
            result = func(*args, **kwargs)
            if (
                func in host_data_factories
                and args
                and not isinstance(args[0], torch.Tensor)
                and isinstance(result, torch.Tensor)
                and result.device.type == self.device_type
                and result.dim() > 0
            ):
                refuse_object_collective(user_source_line)
                # A host-to-device copy of Python data: CUDA refuses it during capture, and a graph
                # would replay the values frozen. (0-d values are kernel scalars on every device.)
                raise CaptureError(
                    "host data copied to the device inside graph capture would be frozen into the graph",
                    op=f"torch.{name}",
                    source=user_source_line(),
                    remedy="create the tensor before capture and pass it in (copy new values into it "
                    "before each replay), or pass the values as host_args of an updatable task",
                )
            return result

    return HostSyncCheck


def _capture_dispatch_mode() -> type:
    """``CaptureDispatchMode``: every op of the capture, at the dispatch level (updatable ops as
    tasks, collectives and host syncs refused, Python-bodied custom ops seen inside, higher-order
    ops of compiled graphs run whole)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class CaptureDispatchMode(TorchDispatchMode):
        def __init__(self, graph: CheckedGraph, auto_update_ops: Sequence[str]) -> None:
            super().__init__()
            self.graph = graph
            self.device_type = graph.device.torch_device.type
            self.auto = frozenset(auto_update_ops)
            self.regions: CompiledRegions | None = None  # set when the backend records ops
            key = {"cpu": "CPU", "cuda": "CUDA"}.get(self.device_type, "PrivateUse1")
            self.key_name = key
            self.keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
            self.host_check: Any = None  # this capture's HostSyncCheck, set by capturing()
            self.seen = 0  # ops this mode saw: what a recording backend records
            # Host ops reading pre-capture CPU tensors: frozen on a device graph (the reference records them).
            self.host_compute = host_compute_for(self.device_type)

        supports_higher_order_operators = True

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            # Dynamo skips compiled frames under a dispatch mode unless it says so: compiled code must
            # run compiled inside a capture (see devgraph.graph._compiled_regions).
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            self.seen += 1
            if isinstance(func, torch._ops.HigherOrderOperator):
                return self._higher_order(func, args, kwargs)
            result = self._dispatch(func, args, kwargs)
            if self.host_compute is not None:
                self.host_compute.check(func, args, kwargs, result)
            return result

        def _dispatch(self, func, args, kwargs):
            check = op_check.get()
            if check is not None:
                check(func, args, kwargs)
            name = func._schema.name
            if is_collective(name):
                refuse_collective(func, args, kwargs, self.device_type, user_source_line)
            remedy = dispatch_refusal(func, args, kwargs)
            if remedy and _on_device((args, kwargs), self.device_type):
                _raise_sync(name, remedy)
            if name in self.auto and self.graph._open_group is None:
                self._refuse_task_in_compiled(name)
                return _call_as_task(self.graph, func, args, kwargs)
            if has_python_kernel(func, self.key_name) and _on_device((args, kwargs), self.device_type):
                # A Python-bodied custom op (vLLM's attention): the check must see what its body
                # launches, or an updatable op inside would be captured with frozen host arguments
                # and no task, and a host sync inside would go unrefused. torch took the host-sync
                # check (a function mode) off the stack for the outer call: put it back too.
                with contextlib.ExitStack() as body:
                    if self.host_check is not None:
                        body.enter_context(self.host_check)
                    body.enter_context(self)
                    return func.redispatch(self.keys, *args, **kwargs)
            return func(*args, **kwargs)

        def _higher_order(self, func, args, kwargs):
            # Compiled graphs (aot_eager's) call higher-order ops, auto_functionalized for a custom
            # op that writes its arguments, say: they run whole inside the compiled graph.
            inner = args[0] if args and isinstance(args[0], torch._ops.OpOverload) else None
            if inner is not None and inner._schema.name in self.auto:
                self._refuse_task_in_compiled(inner._schema.name)
            if self.regions is not None and self.regions.active is None:
                raise CaptureError(
                    "a higher-order op outside compiled code cannot be recorded by this backend",
                    op=str(func.name()),
                    source=user_source_line(),
                    remedy="torch.compile the function that calls it (compiled graphs are recorded whole)",
                )
            return func(*args, **kwargs)

        def _refuse_task_in_compiled(self, name: str) -> None:
            if self.regions is not None and self.regions.active is not None:
                raise CaptureError(
                    "an updatable op inside a compiled graph cannot be captured as a task: its host "
                    "arguments would be frozen into the compiled graph's recording",
                    op=f"{name} in {self.regions.active}",
                    remedy="call this op outside the torch.compile'd region (compile the layers around "
                    "attention), or use mode='piecewise', which compiles the pieces between such ops",
                )

    return CaptureDispatchMode


def _is_tensor_method(func: Callable[..., Any]) -> bool:
    import torch

    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    return (
        owner is torch.Tensor or owner is torch._C.TensorBase or "Tensor" in getattr(func, "__qualname__", "")
    )


def _moves_to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True for ``t.to(cpu)`` of a tensor that is not on the CPU: a device-to-host copy.

    ``t.to(x.device)`` of a tensor already there is a no-op on every device (transformers does it
    every step for rotary tables), so it is allowed, on the CPU reference backend too.
    """
    import torch

    target = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            target = a
    if target is None or torch.device(target).type != "cpu":
        return False
    source = args[0]
    return isinstance(source, torch.Tensor) and source.device.type != "cpu"


def _pageable_upload(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str) -> bool:
    """True for a copy of a pageable host tensor to ``device_type`` (not the CPU) inside capture.

    CUDA refuses a pageable host-to-device copy while capturing (with a message that names
    nothing); a pinned source is captured by address and must outlive the graph, like any input.
    0-d tensors are kernel scalars and stay allowed.
    """
    import torch

    if device_type == "cpu" or not args or not isinstance(args[0], torch.Tensor):
        return False
    if name == "copy_":
        dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
    elif name in ("to", "cuda"):
        dst, src = None, args[0]
        target = kwargs.get("device", "cuda" if name == "cuda" else None)
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                target = a
            elif isinstance(a, torch.Tensor):
                target = a.device
        if target is None or torch.device(target).type != device_type:
            return False
    else:
        return False
    if dst is not None and dst.device.type != device_type:
        return False
    return (
        isinstance(src, torch.Tensor) and src.device.type == "cpu" and src.dim() > 0 and not src.is_pinned()
    )


def _call_as_task(
    graph: CheckedGraph, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    call, args, kwargs, post = graph._prepare_task_call(func, args, kwargs)
    group = TaskGroup.for_call(len(graph.tasks), call, args, kwargs, graph._updatable_tensor_args(call))
    with graph._group(group):
        result = call(*args, **kwargs)
    return result if post is None else post(result)


def _autocast_device_types(device_type: str) -> list[str]:
    """The device types among the CPU and ``device_type`` whose autocast is on in this thread."""
    import torch

    on = []
    for t in dict.fromkeys(("cpu", device_type)):
        try:
            if torch.is_autocast_enabled(t):
                on.append(t)
        except RuntimeError:  # a device type torch's autocast does not know (npu without torch_npu)
            continue
    return on


def refuse_autocast_cache(device_type: str) -> None:
    """Refuse a capture begun inside ``torch.autocast`` with its weight-cast cache on (the default).

    Autocast caches the low-precision casts of weights until its region exits: a capture inside the
    region records reads of those casts (made by a warm-up in the same region, or by the capture
    itself), which are freed when the region exits. A device graph would then read freed memory
    (on CUDA, memory the pool hands to the next graph captured into it); the CPU reference raises at
    the next replay. Autocast entered inside the captured code is fine: its casts are captured.
    """
    import torch

    if not torch.is_autocast_cache_enabled():
        return
    on = _autocast_device_types(device_type)
    if on:
        raise CaptureError(
            f"graph capture inside torch.autocast({on[0]!r}) with its weight cache on: the graph would "
            "read weight casts that autocast frees when its region exits",
            op="torch.autocast",
            source=user_source_line(),
            remedy=f"use torch.autocast({on[0]!r}, ..., cache_enabled=False) around the capture and the "
            "calls that replay it, or enter autocast inside the captured code",
        )


_MODE_CLASSES: tuple[type, type] | None = None


@contextlib.contextmanager
def capturing(graph: CheckedGraph, auto_update_ops: Sequence[str] = ()) -> Iterator[None]:
    """Check the block for host syncs while ``graph`` captures; capture ``auto_update_ops`` as tasks."""
    global _MODE_CLASSES
    if _MODE_CLASSES is None:
        _MODE_CLASSES = _modes()
    check_cls, dispatch_cls = _MODE_CLASSES
    refuse_autocast_cache(graph.device.torch_device.type)
    with contextlib.ExitStack() as stack:
        recorders = op_recorders()  # the backend's op recorder, entered by its _begin_capture
        host_check = stack.enter_context(check_cls(graph.device.torch_device.type))
        dispatch = stack.enter_context(dispatch_cls(graph, auto_update_ops))
        dispatch.host_check = host_check
        if recorders:
            # Compiled graphs bypass the dispatcher in part (inductor): record each one whole.
            dispatch.regions = stack.enter_context(CompiledRegions(recorders))
            host_check.recording = dispatch
            host_check.recorders = recorders
        yield


class _NothingCaptured:
    """The graph ``host_sync_check`` checks against: a device type, no task groups (no op is made a task)."""

    _open_group = None
    tasks = ()

    def __init__(self, device_type: str) -> None:
        import torch

        self.device = types.SimpleNamespace(torch_device=torch.device(device_type))

    def _group(self, group: TaskGroup) -> AbstractContextManager[TaskGroup]:
        raise AssertionError("host_sync_check makes no task groups")

    def _prepare_task_call(self, func: Any, args: Any, kwargs: Any) -> Any:
        raise AssertionError("host_sync_check makes no task groups")

    def _updatable_tensor_args(self, func: Any) -> tuple[str, ...]:
        return ()


@contextlib.contextmanager
def host_sync_check(device_type: str) -> Iterator[None]:
    """Run the block eagerly under the capture check of a capture on ``device_type``: nothing is captured.

    What a capture on that device refuses op by op raises the same ``CaptureError`` here (a host sync
    such as ``.item()``/``.tolist()``, a data-dependent output shape, a device value read on the host,
    host data copied to the device, a pre-capture CPU tensor computed on by the host); what only a
    recording finds (memory made inside the capture and freed when it ends) is left to the capture.
    A dry run that tells before any capture that code cannot be captured (the Hugging Face adapter's
    wrap-time decode step). ``torch.autocast`` around the block is not refused: that is a property of
    where a capture is called, not of the code.
    """
    global _MODE_CLASSES
    if _MODE_CLASSES is None:
        _MODE_CLASSES = _modes()
    check_cls, dispatch_cls = _MODE_CLASSES
    graph = _NothingCaptured(device_type)
    with contextlib.ExitStack() as stack:
        host_check = stack.enter_context(check_cls(device_type))
        dispatch = stack.enter_context(dispatch_cls(graph, ()))
        dispatch.host_check = host_check
        yield


def refuse_unrecorded(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse op ``func``, called from Python during a recording capture, whose kernel ran with no op
    reaching the dispatch mode: a C++ kernel registered as CompositeImplicitAutograd that computes
    itself (vLLM's CPU kernels), or any kernel writing memory directly. The recording holds nothing
    of it, so every replay would skip it. An op given no tensor did nothing a replay could miss."""
    from devgraph.graph._break_calls import tensors
    from devgraph.graph._segment_check import TORCH_NAMESPACES

    name = func._schema.name if hasattr(func, "_schema") else func._qualified_op_name
    if name.partition("::")[0] in TORCH_NAMESPACES or next(iter(tensors((args, kwargs))), None) is None:
        return  # torch's own ops reach the dispatcher or return an input as it is
    raise CaptureError(
        "its kernel ran without any op reaching PyTorch's dispatcher (a C++ kernel registered as "
        "CompositeImplicitAutograd that computes by itself, or one writing memory directly): the "
        "reference backend records what the dispatcher sees, so a replay would skip this op silently",
        op=name,
        source=user_source_line(),
        remedy=f"register its kernel for the device's dispatch key (CPU, CUDA, PrivateUse1) instead of "
        f"CompositeImplicitAutograd, or call it through a torch.library custom op, or run it eagerly "
        f"between graphs: mode='breakable' with devgraph.mark_break({name!r})",
    )
