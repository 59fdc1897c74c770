"""Plugin discovery and backend selection.

Backends (built-in and third-party) are pluggy plugins registered under the ``devgraph``
entry-point group. Their probes are cheap and never raise; the heavy backend module is imported
only when a device of that backend is asked for.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import pluggy

from devgraph import _hookspecs
from devgraph._errors import BackendUnavailable, DevgraphError, PluginLoadError
from devgraph.graph import add_break_source

if TYPE_CHECKING:
    from devgraph.graph import Device

__all__ = ["BackendInfo", "BackendSpec", "Probe", "device", "list_backends", "plugin_manager"]

logger = logging.getLogger("devgraph")

BUILTIN_BACKENDS = ("cpu", "cuda", "npu", "accelerator")
_BUILTIN_MODULES = {name: f"devgraph.backends.{name}" for name in BUILTIN_BACKENDS}


@attrs.frozen
class Probe:
    """What a backend's availability probe found."""

    available: bool
    reason: str = ""
    version: str | None = None
    device_count: int = 0


@attrs.frozen
class BackendSpec:
    """A backend as a plugin registers it.

    Attributes:
        name: the backend's name (``devgraph.device(name)``).
        probe: cheap availability check; must not raise and must not import heavy modules.
        device_class: ``"package.module:Class"`` of its ``Device`` subclass, imported on first use.
        builtin: True for devgraph's own cpu/cuda/npu/accelerator backends.
        device_types: torch device types the backend serves besides its name, asked when a name no
            backend has is requested (the accelerator backend: ``("xpu",)`` on an XPU machine); cheap,
            must not raise.
    """

    name: str
    probe: Callable[[], Probe]
    device_class: str
    builtin: bool = False
    device_types: Callable[[], tuple[str, ...]] | None = None


@attrs.frozen
class BackendInfo:
    """One row of ``devgraph.list_backends()``."""

    name: str
    available: bool
    reason: str
    version: str | None
    plugin: str
    device_count: int


class _Registry:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pm: pluggy.PluginManager | None = None
        self.specs: dict[str, tuple[BackendSpec, str]] = {}
        self.devices: dict[tuple[str, int], Device] = {}


_registry = _Registry()


def _load_plugins(pm: pluggy.PluginManager) -> None:
    autoload = os.environ.get("DEVGRAPH_AUTOLOAD", "1").strip().lower() not in ("0", "false", "no", "off")
    for ep in importlib.metadata.entry_points(group="devgraph"):
        builtin = ep.value in _BUILTIN_MODULES.values()
        if not autoload and not builtin:
            logger.debug("DEVGRAPH_AUTOLOAD=0: skipping plugin %s (%s)", ep.name, ep.value)
            continue
        if pm.has_plugin(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:
            dist = getattr(ep, "dist", None)
            origin = f"{ep.name} = {ep.value}" + (f" (from {dist.name} {dist.version})" if dist else "")
            raise PluginLoadError(origin, exc) from exc
        pm.register(plugin, name=ep.name)
    # A source checkout that was never pip-installed has no entry points: register built-ins directly.
    for name, module in _BUILTIN_MODULES.items():
        mod = importlib.import_module(module)
        if not pm.is_registered(mod):
            pm.register(mod, name=name)


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (plugins load on first call)."""
    with _registry.lock:
        if _registry.pm is None:
            pm = pluggy.PluginManager("devgraph")
            pm.add_hookspecs(_hookspecs)
            if os.environ.get("DEVGRAPH_TRACE_HOOKS"):
                pm.trace.root.setwriter(lambda msg: logger.debug("hook: %s", msg.rstrip()))
                pm.enable_tracing()
            _load_plugins(pm)
            pm.check_pending()
            _registry.pm = pm
        return _registry.pm


def call_each_hookimpl(hook: Any, what: str, kwargs_for: Callable[[str], dict[str, Any]]) -> None:
    """Call every implementation of ``hook`` one by one (pluggy's call order), so that an error
    names the plugin at fault: ``kwargs_for(plugin_name)`` gives each call's arguments.

    With ``DEVGRAPH_TRACE_HOOKS`` set every call is logged (pluggy's own tracing only sees calls
    made through ``pm.hook``).

    Raises:
        DevgraphError: as raised by the implementation (registration conflicts...).
        PluginLoadError: any other exception, naming the plugin and ``what`` it was doing.
    """
    pm = plugin_manager()
    trace = bool(os.environ.get("DEVGRAPH_TRACE_HOOKS"))
    for impl in reversed(hook.get_hookimpls()):
        origin = pm.get_name(impl.plugin) or repr(impl.plugin)
        if trace:
            logger.debug("hook: %s from plugin %r", hook.name, origin)
        try:
            impl.function(**kwargs_for(origin))
        except DevgraphError:
            raise
        except Exception as exc:
            raise PluginLoadError(f"{origin} ({what})", exc) from exc


def _specs() -> dict[str, tuple[BackendSpec, str]]:
    with _registry.lock:
        if _registry.specs:
            return _registry.specs
        specs: dict[str, tuple[BackendSpec, str]] = {}  # published only when every plugin registered

        def register_for(origin: str) -> dict[str, Any]:
            def register(spec: BackendSpec) -> None:
                if not isinstance(spec, BackendSpec):
                    raise DevgraphError(f"plugin {origin!r} registered {spec!r}, not a devgraph.BackendSpec")
                if spec.name in specs:
                    raise DevgraphError(
                        f"backend name {spec.name!r} is registered twice (plugins {specs[spec.name][1]!r} "
                        f"and {origin!r}); uninstall one, or set DEVGRAPH_AUTOLOAD=0"
                    )
                specs[spec.name] = (spec, origin)

            return {"register": register}

        call_each_hookimpl(
            plugin_manager().hook.devgraph_register_backends, "registering backends", register_for
        )
        _registry.specs = specs
        return specs


def _probe(spec: BackendSpec) -> Probe:
    try:
        return spec.probe()
    except Exception as exc:  # a probe must not raise; report instead of failing
        return Probe(False, f"probe raised {type(exc).__name__}: {exc}")


def list_backends() -> list[BackendInfo]:
    """Every registered backend with its availability (built-ins first); ``devgraph info`` prints it."""
    rows = []
    for name, (spec, origin) in _specs().items():
        p = _probe(spec)
        rows.append(BackendInfo(name, p.available, p.reason, p.version, origin, p.device_count))
    order = {n: i for i, n in enumerate(BUILTIN_BACKENDS)}
    rows.sort(key=lambda r: (order.get(r.name, len(order)), r.name))
    return rows


def _select() -> str:
    specs = _specs()
    forced = os.environ.get("DEVGRAPH_BACKEND")
    if forced:
        return forced
    probes = {name: _probe(spec) for name, (spec, _) in specs.items()}
    tiers = (
        [n for n, (s, _) in specs.items() if not s.builtin],
        [n for n in ("cuda", "npu") if n in specs],
        # torch.accelerator.Graph for a device without a dedicated backend (XPU...).
        [n for n in ("accelerator",) if n in specs],
        ["cpu"],
    )
    for tier in tiers:
        found = [n for n in tier if probes.get(n, Probe(False)).available]
        if len(found) > 1:
            raise DevgraphError(
                f"more than one backend is available ({', '.join(found)}); choose one with "
                f"devgraph.device(name) or DEVGRAPH_BACKEND=<name>"
            )
        if found:
            return found[0]
    raise DevgraphError("no devgraph backend is available (not even cpu): is torch installed?")


def _from_torch_device(value: Any, index: int | None) -> tuple[str, int | None]:
    """``(backend name, index)`` of a ``torch.device`` (checked by duck type: torch stays unimported)."""
    kind = getattr(value, "type", None)
    if type(value).__name__ != "device" or not isinstance(kind, str):
        raise DevgraphError(
            f"device must be a backend name ('cpu', 'cuda', 'npu', 'accelerator'), a torch.device or a devgraph.Device, "
            f"got {value!r} ({type(value).__name__})"
        )
    return kind, value.index if index is None else index


def device(name: str | Any | None = None, index: int | None = None) -> Device:
    """The device of backend ``name`` (None: the best available) at ``index`` (default 0).

    ``name`` may be a ``torch.device`` too (``torch.device("cuda", 1)`` is ``device("cuda", 1)``).

    Raises:
        DevgraphError: unknown backend name (the message lists the known ones), or ambiguity.
        BackendUnavailable: the backend is registered but cannot run here (``reason`` says why).
    """
    if name is not None and not isinstance(name, str):
        name, index = _from_torch_device(name, index)
    if name is not None and ":" in name:
        name, _, idx = name.partition(":")
        index = int(idx) if index is None else index
    name = name or _select()
    index = 0 if index is None else index
    with _registry.lock:
        key = (name, index)
        if key in _registry.devices:
            return _registry.devices[key]
        specs = _specs()
        if name not in specs:
            name = _serving(specs, name)
            key = (name, index)
            if key in _registry.devices:
                return _registry.devices[key]
        if name not in specs:
            raise DevgraphError(
                f"unknown devgraph backend {name!r}; known backends: {', '.join(sorted(specs))} "
                "(see `devgraph info`)"
            )
        spec = specs[name][0]
        p = _probe(spec)
        if not p.available:
            raise BackendUnavailable(name, p.reason)
        if index < 0 or (p.device_count and index >= p.device_count):
            raise DevgraphError(f"{name} has {p.device_count} device(s); index {index} is out of range")
        module, _, cls_name = spec.device_class.partition(":")
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, OSError) as exc:
            hint = (
                " (torch_npu is installed without the CANN runtime and torch autoloads it: set "
                "TORCH_DEVICE_BACKEND_AUTOLOAD=0)"
                if "libhccl" in str(exc) or "torch_npu" in str(exc)
                else ""
            )
            raise BackendUnavailable(name, f"importing {module} failed: {exc}{hint}") from exc
        dev = cls(index)
        _registry.devices[key] = dev
        return dev


def _serving(specs: dict[str, tuple[BackendSpec, str]], kind: str) -> str:
    """The backend serving torch device type ``kind`` (its ``device_types``), or ``kind`` itself."""
    for name, (spec, _) in specs.items():
        if spec.device_types is None:
            continue
        try:
            kinds = spec.device_types()
        except Exception as exc:  # like a probe: must not raise; report nothing served
            logger.debug("device_types() of backend %s raised: %s", name, exc)
            continue
        if kind in kinds:
            return name
    return kind


def forget_devices(name: str) -> None:
    """Drop cached devices of backend ``name`` (the torch_npu simulator does this on exit)."""
    with _registry.lock:
        for key in [k for k in _registry.devices if k[0] == name]:
            del _registry.devices[key]


def _reset_for_tests() -> None:
    """Forget loaded plugins and devices (tests that install or break plugins use this)."""
    with _registry.lock:
        _registry.pm = None
        _registry.specs = {}
        _registry.devices = {}


def contributed_break_ops(device: Device | None) -> list[Any]:
    """The break ops plugins contribute for ``device`` through ``devgraph_register_break_ops``."""
    found: list[Any] = []
    call_each_hookimpl(
        plugin_manager().hook.devgraph_register_break_ops,
        "registering break ops",
        lambda origin: {"register": lambda *ops: found.extend(ops), "device": device},
    )
    return found


add_break_source(contributed_break_ops)  # breakable captures ask the plugins through the graph layer
