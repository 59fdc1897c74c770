"""CompileConfig: every option that changes what the piecewise compiler builds and captures."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from devgraph._errors import DevgraphError
from devgraph._modes import MODE_TABLE

if TYPE_CHECKING:
    from devgraph.graph import Device

__all__ = ["MODES", "CompileConfig", "compile_option_names"]

#: Graph modes, after vLLM's CUDAGraphMode.
MODES = tuple(name for name, mode in MODE_TABLE.items() if mode.serves != "breakable")


def _sizes(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    sizes = tuple(sorted({int(v) for v in value}))
    if not sizes or sizes[0] < 1:
        raise DevgraphError(f"capture_sizes must be positive integers, got {list(value)}")
    return sizes


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    return tuple(value)


def _passes(value: Any) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    return tuple(value)


def _traffic(value: Any) -> tuple[tuple[int, float], ...] | None:
    """``{size: weight}``, or a sequence of observed sizes (counted), as sorted pairs."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        pairs: dict[int, float] = {int(k): float(v) for k, v in value.items()}
    else:
        pairs = {}
        for size in value:
            pairs[int(size)] = pairs.get(int(size), 0.0) + 1.0
    if any(k < 1 or v < 0 for k, v in pairs.items()):
        raise DevgraphError(f"traffic needs positive sizes and non-negative weights, got {pairs}")
    return tuple(sorted(pairs.items()))


def _check_mode(instance: Any, attribute: Any, value: str) -> None:
    if value not in MODES:
        raise DevgraphError(f"mode must be one of {', '.join(map(repr, MODES))}, got {value!r}")


def _check_backend(instance: Any, attribute: Any, value: str | None) -> None:
    # Which compilers exist depends on the device (backends contribute theirs): ``check_device``
    # checks the name against them once the device is known.
    if value is not None and (not isinstance(value, str) or not value):
        raise DevgraphError(
            f"compile_backend must be a compiler's name ('eager', 'inductor', or one a backend adds, such "
            f"as 'torchair' on npu) or None (the device's default), got {value!r}"
        )


def _callable_name(fn: Callable[..., Any] | None) -> str | None:
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@attrs.frozen
class CompileConfig:
    """Options of the piecewise compiler (frozen; ``uuid()`` keys caches).

    Attributes:
        mode: ``"piecewise"`` (every call through per-piece graphs), ``"full_and_piecewise"``
            (uniform decode batches through one full graph per batch size, everything else
            piecewise) or ``"full"`` (no piecewise compiler; ``devgraph.wrap``'s default).
        splitting_ops: qualified op names (``"namespace::op"`` or ``"namespace::op.overload"``) to
            cut the graph at, *in addition to* devgraph's attention ops. Each runs eagerly between
            the captured pieces. Validated against ``torch.ops``.
        compile_backend: the compiler of the pieces, ``"eager"``, ``"inductor"`` (cuda, cpu) or
            ``"torchair"`` (npu); None uses the device's ``default_compile_backend`` (``"eager"`` where
            the device declares none). The option keeps torch's word (``torch.compile(backend=...)``).
        passes: pass names or pass objects, in order; None runs the defaults (every built-in pass
            plus those backends contribute through ``devgraph_register_passes``); ``()`` none.
        capture_sizes: token counts to capture pieces for (None: the runner's batch sizes).
        capture_budget: hardware streams captured pieces may use (None: the device's
            ``capture_stream_budget``); sizes beyond it are dropped by ``plan_capture_sizes``.
        traffic: the sizes calls will have, ``{size: weight}`` or a list of observed sizes; the
            planner keeps the sizes that waste the least padding on this traffic.
        is_decode: ``fn(**call_arguments) -> bool``: True for a uniform decode batch (served by the
            full graph in ``full_and_piecewise`` mode). None: the model's ``devgraph_is_decode``.
    """

    mode: str = attrs.field(default="piecewise", validator=_check_mode)
    splitting_ops: tuple[str, ...] = attrs.field(default=(), converter=_names)
    compile_backend: str | None = attrs.field(default=None, validator=_check_backend)
    passes: tuple[Any, ...] | None = attrs.field(default=None, converter=_passes)
    capture_sizes: tuple[int, ...] | None = attrs.field(default=None, converter=_sizes)
    capture_budget: int | None = None
    traffic: tuple[tuple[int, float], ...] | None = attrs.field(default=None, converter=_traffic)
    is_decode: Callable[..., bool] | None = None

    def __attrs_post_init__(self) -> None:
        from devgraph.compile._splitting_ops import resolve_splitting_ops

        resolve_splitting_ops(self.splitting_ops)  # raises naming the op and how to spell it
        if self.capture_budget is not None and self.capture_budget < 1:
            raise DevgraphError(
                f"capture_budget must be a positive number of streams, got {self.capture_budget}"
            )

    def all_splitting_ops(self) -> tuple[str, ...]:
        """devgraph's attention ops followed by ``splitting_ops`` (normalised, de-duplicated)."""
        from devgraph.compile._splitting_ops import resolve_splitting_ops

        return resolve_splitting_ops(self.splitting_ops)

    def uuid(self, device: Device | None = None) -> str:
        """A stable hash of everything that changes the compiled pieces; folds every pass's ``uuid()``.

        ``device`` resolves the default pass list (backends contribute passes per device).
        """
        from devgraph.compile.passes import resolve_passes

        data = attrs.asdict(self, recurse=False)
        data["is_decode"] = _callable_name(self.is_decode)
        data["splitting_ops"] = list(self.all_splitting_ops())
        data["passes"] = [p.uuid() for p in resolve_passes(self.passes, device)]
        if device is not None:
            # What the device makes of the defaults: the same config compiles differently on an NPU
            # with torchair than on one without, and plans sizes for the device's stream budget.
            data["compile_backend"] = self.compiler_for(device)
            data["capture_budget"] = self.effective_budget(device)
            data["max_capture_sizes"] = getattr(device, "max_capture_sizes", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=repr).encode()).hexdigest()[:16]

    def compiler_for(self, device: Device | None) -> str:
        """The compiler pieces get on ``device`` (the config's ``compile_backend``, else the device's default)."""
        if self.compile_backend is not None:
            return self.compile_backend
        default = getattr(device, "default_compile_backend", None) if device is not None else None
        return default or "eager"

    def effective_budget(self, device: Device | None) -> int | None:
        """The stream budget captured pieces plan for: ``capture_budget``, else the device's."""
        if self.capture_budget is not None:
            return self.capture_budget
        return getattr(device, "capture_stream_budget", None) if device is not None else None

    def check_device(self, device: Device) -> None:
        """Raise ``DevgraphError`` when ``device`` has no such compiler, or a pass named is unknown
        (refused when a runner is built, not at its first trace).

        ``eager`` and ``inductor`` run anywhere torch does; a backend adds its device's own through
        ``devgraph_register_compilers`` (``torchair``: the NPU backend).
        """
        from devgraph.compile._compilers import compilers_for
        from devgraph.compile.passes import resolve_passes

        resolve_passes(self.passes, device)
        backend = self.compiler_for(device)
        available = compilers_for(device)
        if backend not in available:
            raise DevgraphError(
                f"compile_backend={backend!r} is not a compiler of {device.name}, where this runner captures "
                f"(its compilers: {', '.join(map(repr, sorted(available)))}; 'torchair' comes with the npu "
                "backend); pick one of those, or None (the device's default)"
            )


def compile_option_names() -> tuple[str, ...]:
    """Options ``devgraph.wrap`` passes to ``CompileConfig`` (``mode`` is shared with RunnerConfig)."""
    return tuple(f.name for f in attrs.fields(CompileConfig) if f.name != "mode")
