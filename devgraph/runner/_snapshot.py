"""Everything a wrapped model holds besides its outputs: snapshot before capture, diff and restore after.

Warm-ups, capture and the padding check run the forward several times. Whatever it changes outside
its outputs would otherwise advance once per run: a counter in a plain tensor attribute, a list it
appends to, a field of a config object, a tensor it stores on itself, a parameter it writes in place.
``StateSnapshot`` walks everything reachable from the wrapped callable -- a module's parameters,
buffers and attributes, plain objects and containers below them, a function's closure cells and
defaults, ``torch.Generator`` objects -- and records tensors by identity, version, storage and value
(a clone; a checksum for parameters too large to copy), containers and objects by a shallow copy,
generators by their state, and the global random-number generators (the CPU one and the capture
device's). ``changes()`` names what differs, ``restore()`` puts all of it back.

What a graph can replay like eager is a tensor written in place (the graph writes the same memory at
every replay): put back, it advances once per real call. Everything else -- a Python value, a
container, a tensor rebound or resized -- is frozen by a graph: the caller refuses the capture and
names it (``Change.replayable`` is False). The walk is bounded (``_MAX_OBJECTS`` objects,
``_MAX_DEPTH`` levels below a module attribute) and skips functions, classes, Python modules and
torch's, devgraph's and the standard library's own objects.
"""

from __future__ import annotations

import collections
import enum
import functools
import sys
import types
from typing import Any

import attrs
import torch

from devgraph.runner._tensors import same_values, tensor_version

__all__ = ["Change", "StateSnapshot"]

#: Values compared by value (immutable): a change is a rebinding, which a graph freezes.
_SCALARS = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
#: An nn.Module's own bookkeeping in its ``__dict__`` (walked through its own tables instead).
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}
#: Parameters above this many elements are checked by checksum, not copied (the weights of a large
#: model would otherwise be copied whole at capture); one written in place cannot be put back.
_CLONE_LIMIT = 1 << 20
_MAX_OBJECTS = 100_000
_MAX_DEPTH = 8
_SKIP_TYPES = (
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    types.CodeType,
    types.FrameType,
    property,
    staticmethod,
    classmethod,
)
#: Plain objects of these packages are not walked: torch's and the standard library's internals, and
#: devgraph's own (its adapters keep their caches themselves; its test models are walked as user code).
_SKIP_MODULES = ("devgraph.", "threading", "_thread", "weakref", "logging", "torch.", "builtins")


def plain_object(value: Any) -> bool:
    """True for an object whose attributes are walked: not a torch, devgraph or standard-library one."""
    module = type(value).__module__ or ""
    return not module.startswith(_SKIP_MODULES) or module.startswith("devgraph.testing")


@attrs.frozen
class Change:
    """One thing the forward changed: ``path`` names it (``layers.0.count``, ``cfg.step``,
    ``history``), ``what`` says how; ``replayable``: a graph replays it as eager does (a tensor
    written in place), so putting it back is enough."""

    path: str
    what: str
    replayable: bool


def _checksum(t: torch.Tensor) -> tuple[int, ...]:
    """A value checksum of a tensor too large to copy: the sum of its bytes read as integers,
    whole and over every other element (a write that keeps both is vanishingly unlikely)."""
    flat = t.detach().reshape(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size())
    if ints is None or flat.dtype.is_complex or flat.dtype == torch.bool:
        flat = flat.view(torch.uint8) if flat.element_size() == 1 else flat.contiguous().view(torch.uint8)
        ints = torch.uint8
    view = flat.view(ints)
    return (int(view.sum(dtype=torch.int64)), int(view[::2].sum(dtype=torch.int64)))


class _TensorRecord:
    """A tensor as it was: identity, version, storage, shape, and its values (or a checksum)."""

    def __init__(self, path: str, kind: str, t: torch.Tensor) -> None:
        self.path, self.kind, self.tensor = path, kind, t
        self.version = tensor_version(t)
        self.geometry = (t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)
        self.alias = t.detach()  # the original storage, to put back a tensor whose .data was replaced
        self.meta = t.device.type == "meta"
        large = kind == "parameter" and t.numel() > _CLONE_LIMIT
        with torch.no_grad():
            self.saved: torch.Tensor | None = None if large or self.meta else t.detach().clone()
            self.checksum = _checksum(t) if large and not self.meta else None

    def geometry_now(self) -> tuple[Any, ...]:
        t = self.tensor
        return (t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)

    def change(self) -> str | None:
        """How the tensor changed since the snapshot (None: it did not)."""
        if self.geometry_now() != self.geometry:
            return "its storage or shape was replaced (.data =, resize_, set_)"
        if self.meta:
            return None
        # Values, not the version: a kernel that writes memory directly (an extension op, ``.data``)
        # leaves the version alone, and a write of the same values changes nothing.
        if self.saved is not None:
            if not same_values(self.tensor.detach(), self.saved):
                bumped = self.version is None or tensor_version(self.tensor) != self.version
                return "written in place" if bumped else "written in place (without a version bump)"
            return None
        if self.checksum is not None and _checksum(self.tensor) != self.checksum:
            return "written in place (too large for devgraph to keep a copy, so it cannot be put back)"
        return None

    def restore(self) -> None:
        t = self.tensor
        with torch.no_grad():
            if self.geometry_now() != self.geometry:
                t.data = self.alias
            if self.saved is not None and not same_values(t.detach(), self.saved):
                t.copy_(self.saved)


class _ContainerRecord:
    """A list, dict, set or object's attributes as they were: a shallow copy (values by identity)."""

    def __init__(
        self, path: str, obj: Any, kind: str, role: str = "", skip: frozenset[str] = frozenset()
    ) -> None:
        # ``path``: where it is; ``role``: what its keys are ("parameter", "buffer", "submodule",
        # "attribute"; "" for a plain container, named as a whole)
        self.path, self.obj, self.kind, self.role, self.skip = path, obj, kind, role, skip
        self.saved: Any = self._now()

    def _now(self) -> Any:
        obj = self.obj
        if self.kind == "list":
            return list(obj)
        if self.kind == "set":
            return set(obj)
        if self.kind == "deque":
            return collections.deque(obj)
        if self.kind == "slots":
            return {k: getattr(obj, k, _MISSING) for k in _slot_names(type(obj))}
        table = obj if self.kind == "dict" else vars(obj)
        return {k: v for k, v in table.items() if k not in self.skip}

    def changes(self) -> list[Change]:
        """What differs from the snapshot (a graph freezes all of it: never replayable)."""
        now = self._now()
        if self.kind in ("list", "deque", "set"):
            if self.kind == "set":
                same = now == self.saved
            else:
                same = len(now) == len(self.saved) and all(_same(a, b) for a, b in zip(now, self.saved))
            if same:
                return []
            old, new = _short(type(now)(self.saved)), _short(now)
            return [Change(self.path, f"{self.kind} {self.path} changed ({old} -> {new})", False)]
        found = []
        for key in self.changed_keys():
            old, new = _short(self.saved.get(key, _MISSING)), _short(now.get(key, _MISSING))
            if not self.role:
                found.append(
                    Change(self.path, f"dict {self.path} changed at {key!r} ({old} -> {new})", False)
                )
                continue
            name = f"{self.path}.{key}" if self.path else key
            if self.role == "attribute":
                found.append(Change(name, f"attribute {name} ({old} -> {new})", False))
            else:
                found.append(Change(name, f"{self.role} {name!r} rebound ({old} -> {new})", False))
        return found

    def changed_keys(self) -> list[str]:
        now = self._now()
        return [
            k for k in {**self.saved, **now} if not _same(self.saved.get(k, _MISSING), now.get(k, _MISSING))
        ]

    def restore(self) -> None:
        obj, saved = self.obj, self.saved
        if self.kind == "list":
            obj[:] = saved
        elif self.kind in ("set", "deque"):
            obj.clear()
            obj.update(saved) if self.kind == "set" else obj.extend(saved)
        elif self.kind == "slots":
            for key, value in saved.items():
                if value is _MISSING:
                    if hasattr(obj, key):
                        object.__delattr__(obj, key)
                elif getattr(obj, key, _MISSING) is not value:
                    object.__setattr__(obj, key, value)
        else:
            table = obj if self.kind == "dict" else vars(obj)
            for key in self.changed_keys():
                if saved.get(key, _MISSING) is _MISSING:
                    del table[key]
                else:
                    table[key] = saved[key]


class _GeneratorRecord:
    def __init__(self, path: str, gen: torch.Generator) -> None:
        self.path, self.gen, self.state = path, gen, gen.get_state()

    def restore(self) -> None:
        self.gen.set_state(self.state)


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    """The same slot value: the same object, or an equal scalar of the same type (or a tuple or
    frozenset of such, item by item)."""
    if a is b:
        return True
    if type(a) is type(b) and isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is type(b) and isinstance(a, frozenset):
        return a == b and all(isinstance(x, _SCALARS) for x in a)
    if type(a) is type(b) and isinstance(a, _SCALARS):
        try:
            return bool(a == b)
        except Exception:
            return False
    return False


def _short(value: Any) -> str:
    if value is _MISSING:
        return "<unset>"
    if isinstance(value, torch.Tensor):
        return f"<tensor {list(value.shape)} at {value.data_ptr():#x}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _slot_names(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.extend(
            [slots] if isinstance(slots, str) else [s for s in slots if s not in ("__dict__", "__weakref__")]
        )
    return names


def _global_generators(device: torch.device) -> list[tuple[str, Any, Any]]:
    """``(name, get, set)`` for the CPU generator and the capture device's own default generator
    (``torch.<type>.get_rng_state(device)``, as torch.random.fork_rng finds them), where its device
    module has one. Only that device's: reading every device's would start a context on each."""
    found: list[tuple[str, Any, Any]] = [
        ("torch.default_generator", torch.get_rng_state, torch.set_rng_state)
    ]
    mod = getattr(torch, device.type, None) if device.type != "cpu" else None
    get = getattr(mod, "get_rng_state", None)
    put = getattr(mod, "set_rng_state", None)
    if get is not None and put is not None:
        try:
            get(device)
        except Exception:  # a device module without a generator of its own (it draws on the CPU's)
            return found
        found.append((f"{device} generator", lambda: get(device), lambda state: put(state, device)))
    return found


def traced_state(fn: object) -> dict[str, Any] | None:
    """The state a callable Dynamo traced declares (``fn.devgraph_traced_state()``): the tensors its
    graph may write in place, by name. Dynamo guards the Python values such a callable reads and
    replays its side effects, so the runner snapshots these tensors only and guards no attribute
    (``AttributeGuard``). None: an untraced callable (everything reachable from it is walked)."""
    get = getattr(fn, "devgraph_traced_state", None)
    return get() if callable(get) else None


class StateSnapshot:
    """What ``fn`` holds besides its outputs, as it is now (see the module docstring).

    Args:
        fn: the wrapped model or callable.
        device: the capture device (its default generator is saved with the CPU's).
    """

    def __init__(self, fn: object, device: torch.device | None = None) -> None:
        self.tensors: list[_TensorRecord] = []
        self.containers: list[_ContainerRecord] = []
        self.generators: list[_GeneratorRecord] = []
        found = _global_generators(device if device is not None else torch.device("cpu"))
        self.rng = [(name, put, get()) for name, get, put in found]
        self._seen: set[int] = set()
        self._count = 0
        self._walk_root(fn)
        self._seen.clear()

    # -- the walk ------------------------------------------------------------------------------

    def _enter(self, obj: Any) -> bool:
        if id(obj) in self._seen or self._count >= _MAX_OBJECTS:
            return False
        self._seen.add(id(obj))
        self._count += 1
        return True

    def _walk_root(self, fn: object) -> None:
        traced = traced_state(fn)
        if traced is not None:  # Dynamo guards its Python values: only the tensors its graph may write
            for name, value in traced.items():
                self._walk_value(name, value, 0)
        elif isinstance(fn, torch.nn.Module):
            self._walk_module("", fn)
        elif isinstance(fn, types.MethodType):  # model.forward: the model, and the function's closure
            self._walk_value("", fn.__self__, 0)
            if isinstance(fn.__func__, types.FunctionType):
                self._walk_function(fn.__func__)
        elif isinstance(fn, types.FunctionType):
            self._walk_function(fn)
        elif isinstance(fn, functools.partial):
            if isinstance(fn.func, types.FunctionType):
                self._walk_function(fn.func)
            self._walk_value("partial arguments", (fn.args, fn.keywords), 0)
        else:
            self._walk_value("", fn, 0)

    def _walk_function(self, fn: types.FunctionType) -> None:
        if not self._enter(fn):
            return
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self._walk_value(f"closure {name!r}", value, 1)
        if fn.__defaults__:
            self._walk_value("defaults", fn.__defaults__, 1)
        if fn.__kwdefaults__:
            self._walk_value("keyword defaults", fn.__kwdefaults__, 1)

    def _walk_module(self, prefix: str, module: torch.nn.Module) -> None:
        for name, sub in module.named_modules(prefix=prefix):
            if not self._enter(sub):
                continue
            dot = f"{name}." if name else ""
            for table_name, role in (
                ("_parameters", "parameter"),
                ("_buffers", "buffer"),
                ("_modules", "submodule"),
            ):
                table = sub.__dict__.get(table_name)
                if table is None:
                    continue
                self.containers.append(_ContainerRecord(name, table, "dict", role))
                if role != "submodule":
                    for key, t in table.items():
                        if isinstance(t, torch.Tensor) and self._enter(t):
                            self.tensors.append(_TensorRecord(dot + key, role, t))
            self.containers.append(_ContainerRecord(name, sub, "attrs", "attribute", _MODULE_INTERNALS))
            for key, value in vars(sub).items():
                if key not in _MODULE_INTERNALS:
                    self._walk_value(dot + key, value, 1)

    def _walk_value(self, path: str, value: Any, depth: int) -> None:
        if isinstance(value, _SCALARS) or isinstance(value, _SKIP_TYPES) or depth > _MAX_DEPTH:
            return
        if isinstance(value, torch.Tensor):
            if self._enter(value):
                self.tensors.append(_TensorRecord(path, "tensor attribute", value))
            return
        if isinstance(value, torch.Generator):
            if self._enter(value):
                self.generators.append(_GeneratorRecord(path, value))
            return
        if isinstance(value, torch.nn.Module):
            self._walk_module(path, value)
            return
        if not self._enter(value):
            return
        if isinstance(value, (tuple, frozenset)):
            for i, item in enumerate(value):
                self._walk_value(f"{path}[{i}]", item, depth + 1)
            return
        if isinstance(value, list):
            self.containers.append(_ContainerRecord(path, value, "list"))
            for i, item in enumerate(value):
                self._walk_value(f"{path}[{i}]", item, depth + 1)
            return
        if isinstance(value, collections.deque):
            self.containers.append(_ContainerRecord(path, value, "deque"))
            for i, item in enumerate(value):
                self._walk_value(f"{path}[{i}]", item, depth + 1)
            return
        if isinstance(value, set):
            self.containers.append(_ContainerRecord(path, value, "set"))
            return
        if isinstance(value, dict):
            self.containers.append(_ContainerRecord(path, value, "dict"))
            for key, item in value.items():
                self._walk_value(f"{path}[{key!r}]", item, depth + 1)
            return
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(value, numpy.ndarray):
            return  # NumPy arrays: not walked (a forward that writes one in place is not seen)
        if not plain_object(value):
            return
        if hasattr(value, "__dict__") and isinstance(vars(value), dict):
            self.containers.append(_ContainerRecord(path, value, "attrs", "attribute"))
            for key, item in vars(value).items():
                self._walk_value(f"{path}.{key}", item, depth + 1)
        elif _slot_names(type(value)):
            self.containers.append(_ContainerRecord(path, value, "slots", "attribute"))
            for key in _slot_names(type(value)):
                self._walk_value(f"{path}.{key}", getattr(value, key, None), depth + 1)

    # -- diff and restore ----------------------------------------------------------------------

    def changes(self) -> list[Change]:
        """What differs from the snapshot, tensors first (the random-number generators aside:
        ``restore`` puts them back, and a graph replays their draws as eager does)."""
        found = []
        for rec in self.tensors:
            what = rec.change()
            if what is not None:
                replayable = what.startswith("written in place") and rec.saved is not None
                found.append(Change(rec.path, f"{rec.kind} {rec.path!r} {what}", replayable))
        for crec in self.containers:
            found.extend(crec.changes())
        for grec in self.generators:
            if not torch.equal(grec.gen.get_state(), grec.state):
                found.append(Change(grec.path, f"generator {grec.path} drew numbers (put back)", True))
        return found

    def restore(self) -> None:
        """Put back every tensor's values and storage, every container's and object's contents,
        every generator's state and the global generators'."""
        for crec in self.containers:
            crec.restore()
        for rec in self.tensors:
            rec.restore()
        self.restore_rng()

    def restore_rng(self) -> None:
        """Put the random-number generators back (the global ones and those the model holds)."""
        for grec in self.generators:
            grec.restore()
        for _, put, state in self.rng:
            put(state)

    def tensor_values(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per tensor written since the snapshot (values only, same storage): its values now and
        the mask of elements that differ from the snapshot."""
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for rec in self.tensors:
            if rec.saved is None or rec.geometry_now() != rec.geometry:
                continue
            now = rec.tensor.detach()
            if same_values(now, rec.saved):
                continue
            differs = now != rec.saved
            if now.is_floating_point() or now.is_complex():
                differs &= ~(now.isnan() & rec.saved.isnan())
            out[rec.path] = (now.clone(), differs)
        return out
