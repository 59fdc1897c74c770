"""RunnerConfig: every option that changes what a GraphRunner captures."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import attrs

from devgraph._errors import DevgraphError

__all__ = ["RunnerConfig", "RunnerStats", "make_config"]


# Converters accept their own output too, so ``attrs.evolve(config, ...)`` works.


def _frozen_map(value: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(dict(value or {}).items()))


def _host_args(value: Any) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, Mapping):
        return tuple(sorted(value.items()))
    return tuple(tuple(item) if isinstance(item, tuple) else (item, item) for item in value)  # type: ignore[misc]


def _debug_default() -> bool:
    return os.environ.get("DEVGRAPH_DEBUG", "").strip() not in ("", "0", "false", "no")


@attrs.frozen
class RunnerConfig:
    """Options of ``devgraph.wrap`` / ``GraphRunner`` (frozen; ``uuid()`` keys caches).

    Attributes:
        batch_sizes: buckets to capture (None: ``default_batch_sizes(max_batch_size)``).
        max_batch_size: the largest bucket (always captured).
        batch_dims: argument name -> batch dimension (default 0 for every tensor argument).
        static_args: tensor arguments passed unchanged every call (not copied, not padded).
        pad_values: argument name -> fill value for padded rows (default 0).
        host_args: host-list arguments (one value per batch row) forwarded to the graph's updatable
            tasks at every replay; a name, a sequence of names, or {call argument: op argument}.
        clone_outputs: return copies instead of views of the graph's output memory.
        strict: raise instead of falling back to eager.
        debug: verify at replay that inputs and parameters live at their capture addresses.
        warmup_iters: eager runs before each capture.
        mode: "full", "piecewise" or "full_and_piecewise" (see devgraph.compile).
    """

    batch_sizes: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(int(x) for x in v)
    )
    max_batch_size: int | None = None
    batch_dims: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=_frozen_map)
    static_args: tuple[str, ...] = attrs.field(default=(), converter=lambda v: tuple(sorted(v or ())))
    pad_values: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_frozen_map)
    host_args: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_host_args)
    clone_outputs: bool = False
    strict: bool = False
    debug: bool = attrs.field(factory=_debug_default)
    warmup_iters: int = 2
    mode: str = "full"

    def __attrs_post_init__(self) -> None:
        if self.mode not in ("full", "piecewise", "full_and_piecewise"):
            raise DevgraphError(
                f"mode must be 'full', 'piecewise' or 'full_and_piecewise', got {self.mode!r}"
            )
        if self.warmup_iters < 0:
            raise DevgraphError(f"warmup_iters must be >= 0, got {self.warmup_iters}")

    def uuid(self) -> str:
        """A stable hash of everything that changes the captured graphs."""
        data = attrs.asdict(self, recurse=True)
        data.pop("debug")  # checks only; captures the same graphs
        data.pop("strict")
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=repr).encode()).hexdigest()[:16]

    def batch_dim(self, name: str) -> int:
        return dict(self.batch_dims).get(name, 0)

    def pad_value(self, name: str) -> Any:
        return dict(self.pad_values).get(name, 0)


@attrs.define
class RunnerStats:
    """Counters of a GraphRunner (``graphed.stats``)."""

    replays: int = 0
    eager_calls: int = 0
    fallbacks: dict[str, int] = attrs.field(factory=dict)
    capture_seconds: float = 0.0
    pool_bytes: int = 0
    captured_sizes: tuple[int, ...] = ()


def make_config(cls: Any, options: Mapping[str, Any], extra_valid: Any = (), what: str = "") -> Any:
    """Build the attrs config ``cls`` from ``options``, naming unknown options and the valid ones.

    ``extra_valid`` are names the caller handles itself (listed as valid, not passed to ``cls``).
    """
    valid = [f.name for f in attrs.fields(cls)] + list(extra_valid)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise DevgraphError(f"unknown option(s) {unknown}{what}; valid options: {', '.join(valid)}")
    return cls(**{k: v for k, v in options.items() if k not in extra_valid})
