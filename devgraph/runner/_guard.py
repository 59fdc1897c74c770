"""``AttributeGuard``: the Python values a forward reads besides its arguments, compared at every call.

A graph replays what the forward computed at capture, Python values included: a flag
(``model.use_lora``), a hyperparameter (``model.temperature``), a training flag, a config object's
field, a tensor held in a plain attribute or a closure. Set after capture, eager would read the new
value; a replay would not. The guard records, at capture, every such value the forward may read and
compares them at each call; the runner captures again when one changed.

What "may read" means: the names the forward's code loads (``co_names``, and string constants for
``self.opts["temp"]``), followed through the methods and module-level functions it names, over the
classes of every submodule and plain object the model holds (``read_names``). An attribute of a
module or of a plain object below it whose name is among them is guarded, as are a wrapped
function's closure cells and defaults. Per call: one C++ call checks that no dict holding a guarded
value was written (torch's Dynamo guard manager, a dict-version guard per dict: about 13 ns a dict);
a dict written between calls without a guarded value changing (a counter the forward never reads
beside a flag it does) is checked value by value from then on, in Python (the identity of each
value, about 30 ns a value), as everything is where torch lacks the C++ check. A changed value is
compared once more by value (``model.t = 0.5`` set again to an equal float changes nothing).

Not seen: a value read by a name the code builds at run time (``getattr(self, name)``), globals of the
model's Python module, and state mutated inside a container that is not a dict, list or object.
"""

from __future__ import annotations

import functools
import operator
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from devgraph.runner._snapshot import _MODULE_INTERNALS, _SCALARS, _SKIP_TYPES, _same, _short, plain_object

__all__ = ["AttributeGuard", "read_names"]

_MAX_ENTRIES = 50_000
_MAX_DEPTH = 3


def _code_names(code: types.CodeType, out: set[str]) -> None:
    out.update(code.co_names)
    for const in code.co_consts:
        if isinstance(const, str):
            out.add(const)
        elif isinstance(const, types.CodeType):
            _code_names(const, out)


def _functions(obj: Any) -> list[types.FunctionType]:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        return [f for f in (obj.fget,) if isinstance(f, types.FunctionType)]
    return [obj] if isinstance(obj, types.FunctionType) else []


def read_names(fn: object, classes: set[type]) -> tuple[set[str], list[tuple[dict[str, Any], str]]]:
    """The attribute names ``fn`` (and ``classes``' methods it reaches by name) may read, and the
    globals it reads that hold a tensor or a scalar (``(globals dict, name)``).

    Starts from ``fn``'s own code (a function, or the ``forward`` of every module class in
    ``classes``) and follows names that are methods of ``classes`` or functions among a visited
    function's globals (not torch's own: they read their arguments, not the model)."""
    mro = [c for k in classes for c in k.__mro__ if c not in (torch.nn.Module, object)]
    todo: list[types.FunctionType] = []
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    if isinstance(fn, types.FunctionType):
        todo.append(fn)
    for cls in classes:
        for name in ("forward", "__call__"):
            for klass in cls.__mro__:
                if klass in (torch.nn.Module, object):
                    break
                if name in klass.__dict__:
                    todo.extend(_functions(klass.__dict__[name]))
                    break
    names: set[str] = set()
    values: list[tuple[dict[str, Any], str]] = []
    seen: set[types.CodeType] = set()
    while todo:
        func = todo.pop()
        if func.__code__ in seen:
            continue
        seen.add(func.__code__)
        found: set[str] = set()
        _code_names(func.__code__, found)
        names |= found
        for name in found:
            for klass in mro:
                if name in klass.__dict__:
                    todo.extend(_functions(klass.__dict__[name]))
            value = func.__globals__.get(name, _GONE)
            if isinstance(value, types.FunctionType) and not (value.__module__ or "").startswith("torch"):
                todo.append(value)
            elif isinstance(value, (torch.Tensor, _SCALARS)) and not name.startswith("__"):
                values.append((func.__globals__, name))
    return names, values


class AttributeGuard:
    """What a forward may read besides its arguments and weights, as it was at capture.

    ``changed()`` (every call) returns None while every value is the one captured, else the first
    that changed, described (``attribute use_lora (True -> False)``).
    """

    def __init__(self, fn: object) -> None:
        # Entries: a dict and a key (module and object attributes, dict items), or an object and an
        # attribute name (closure cells, slots): where a value is read, its path, the value.
        self._tables: list[Any] = []
        self._keys: list[Any] = []
        self._table_paths: list[str] = []
        self._table_values: list[Any] = []
        self._objects: list[Any] = []
        self._names: list[str] = []
        self._object_paths: list[str] = []
        self._object_values: list[Any] = []
        self._seen: set[int] = set()
        classes: set[type] = set()
        if isinstance(fn, torch.nn.Module):
            classes.update(type(m) for m in fn.modules())
        elif isinstance(fn, types.MethodType) and isinstance(fn.__self__, torch.nn.Module):
            classes.update(type(m) for m in fn.__self__.modules())
        self._names_read, read_globals = read_names(fn, classes)
        for table, name in read_globals:
            self._entry(table, name, f"global {name}", table[name], 0)
        self._root(fn)
        self._seen.clear()
        self._object_ids = list(map(id, self._object_values))
        self._demoted: set[int] = set()  # ids of tables checked in Python (written between calls)
        self._versioned: Callable[[], bool] | None = None
        self._versions: dict[int, int] = {}
        self._arm()

    def __len__(self) -> int:
        return len(self._table_values) + len(self._object_values)

    # -- what is guarded -------------------------------------------------------------------------

    def _root(self, fn: object) -> None:
        if isinstance(fn, types.MethodType):
            self._value("", fn.__self__, 0)
            fn = fn.__func__
        if isinstance(fn, types.FunctionType):
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                self._attribute(cell, "cell_contents", f"closure {name!r}")
            self._attribute(fn, "__defaults__", "defaults")
            self._attribute(fn, "__kwdefaults__", "keyword defaults")
            return
        self._value("", fn, 0)

    def _attribute(self, obj: Any, name: str, path: str) -> None:
        try:
            value = getattr(obj, name)
        except (AttributeError, ValueError):  # an empty cell
            return
        self._objects.append(obj)
        self._names.append(name)
        self._object_paths.append(path)
        self._object_values.append(value)
        self._value(path, value, 1)

    def _entry(self, table: Any, key: Any, path: str, value: Any, depth: int) -> None:
        if len(self._table_values) >= _MAX_ENTRIES:
            return
        self._tables.append(table)
        self._keys.append(key)
        self._table_paths.append(path)
        self._table_values.append(value)
        self._value(path, value, depth + 1)

    def _value(self, path: str, value: Any, depth: int) -> None:
        if (
            isinstance(value, (_SCALARS, torch.Tensor, _SKIP_TYPES))
            or depth > _MAX_DEPTH
            or id(value) in self._seen
        ):
            return
        self._seen.add(id(value))
        dot = f"{path}." if path else ""
        names = self._names_read
        if isinstance(value, torch.nn.Module):
            for prefix, module in value.named_modules(prefix=path):
                self._seen.add(id(module))
                table, mdot = vars(module), f"{prefix}." if prefix else ""
                for key, item in table.items():
                    if key in names and (key == "training" or key not in _MODULE_INTERNALS):
                        self._entry(table, key, mdot + key, item, depth)
            return
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and key in names:
                    self._entry(value, key, f"{path}[{key!r}]", item, depth)
            return
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value[:16]):
                if isinstance(value, list):
                    self._entry(value, i, f"{path}[{i}]", item, depth)
                else:
                    self._value(f"{path}[{i}]", item, depth + 1)
            return
        if not plain_object(value):
            return
        table = getattr(value, "__dict__", None)
        if isinstance(table, dict):
            for key, item in table.items():
                if key in names:
                    self._entry(table, key, dot + key, item, depth)

    # -- the check ---------------------------------------------------------------------------------

    def _arm(self) -> None:
        """Split the entries between the C++ dict-version check (tables whose version is still the
        one recorded) and the Python identity check (the rest, and where torch lacks the former)."""
        tables = {id(t): t for t in self._tables if isinstance(t, dict) and id(t) not in self._demoted}
        self._versioned = _version_check(list(tables.values()))
        if self._versioned is None:
            tables = {}
        self._versions = {i: dict_version(t) for i, t in tables.items()} if tables else {}
        keep = [i for i, t in enumerate(self._tables) if id(t) not in tables]
        self._py_tables = [self._tables[i] for i in keep]
        self._py_keys = [self._keys[i] for i in keep]
        self._py_ids = [id(self._table_values[i]) for i in keep]

    def changed(self) -> str | None:
        """None when every guarded value is the captured one (the per-call fast path); else the first
        that changed, described. An equal scalar rebound (``model.t = 0.5`` again) is accepted."""
        try:
            if (
                (self._versioned is None or self._versioned())
                and list(map(id, map(operator.getitem, self._py_tables, self._py_keys))) == self._py_ids
                and (
                    not self._objects
                    or list(map(id, map(getattr, self._objects, self._names))) == self._object_ids
                )
            ):
                return None
        except (KeyError, IndexError, AttributeError, ValueError):
            pass
        found = self._first_change()
        if found is None:  # a table was written, but no value the forward reads changed: look again
            moved = {
                i
                for i, t in enumerate_tables(self._tables)
                if self._versions.get(i, -1) not in (-1, dict_version(t))
            }
            self._demoted |= moved  # written between calls: checked value by value from now on
            self._arm()
        return found

    def _first_change(self) -> str | None:
        for i, (table, key) in enumerate(zip(self._tables, self._keys)):
            try:
                now = table[key]
            except (KeyError, IndexError):
                now = _GONE
            if now is not self._table_values[i]:
                if not _same(now, self._table_values[i]):
                    path = self._table_paths[i]
                    kind = "" if path.startswith("global ") else "attribute "
                    return f"{kind}{path} ({_short(self._table_values[i])} -> {_short(now)})"
                self._table_values[i] = now  # equal: the same graphs serve
        for i, (obj, name) in enumerate(zip(self._objects, self._names)):
            try:
                now = getattr(obj, name)
            except (AttributeError, ValueError):
                now = _GONE
            if now is not self._object_values[i]:
                if not _same(now, self._object_values[i]):
                    return f"{self._object_paths[i]} ({_short(self._object_values[i])} -> {_short(now)})"
                self._object_values[i], self._object_ids[i] = now, id(now)
        return None


_GONE = object()


def enumerate_tables(tables: list[Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(id, table)`` for each distinct dict among ``tables``."""
    seen: set[int] = set()
    for table in tables:
        if isinstance(table, dict) and id(table) not in seen:
            seen.add(id(table))
            yield id(table), table


def dict_version(table: dict[str, Any]) -> int:
    """The dict's version tag (PEP 509: changed by every write), -1 where torch cannot read it."""
    try:
        from torch._C._dynamo.guards import dict_version as version

        return int(version(table))
    except Exception:
        return -1


_VERSIONS_WORK: list[bool] = []


def _version_check(tables: list[dict[str, Any]]) -> Callable[[], bool] | None:
    """One C++ call that is True while no dict of ``tables`` was written since now: torch's Dynamo
    guard manager with a dict-version guard per table (about 13 ns a table, against about 30 ns a
    value in Python). None where this torch or Python lacks it (proven once per process on a
    scratch dict), or for no tables."""
    if not tables:
        return None
    try:
        from torch._C._dynamo.guards import RootGuardManager
        from torch._dynamo.guards import GuardManagerType

        def build(dicts: list[dict[str, Any]]) -> Callable[[], bool]:
            root = RootGuardManager()
            holder = {"tables": dicts}
            kind = GuardManagerType.GUARD_MANAGER
            listed = root.dict_getitem_manager(
                key="tables", source="tables", example_value=dicts, guard_manager_enum=kind
            )
            for i, table in enumerate(dicts):
                listed.list_getitem_manager(
                    key=i, source=f"tables[{i}]", example_value=table, guard_manager_enum=kind
                ).add_dict_version_guard(table, [f"tables[{i}] unchanged"], None)
            return functools.partial(root.check, holder)

        if not _VERSIONS_WORK:
            scratch: dict[str, Any] = {"a": 1}
            check = build([scratch])
            before = check()
            scratch["a"] = 2
            _VERSIONS_WORK.append(before and not check())
        if not _VERSIONS_WORK[0]:
            return None
        check = build(tables)
        return check if check() else None
    except Exception:  # another torch: its guard manager's API differs
        return None
