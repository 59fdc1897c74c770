"""RunnerConfig: every option that changes what a GraphRunner captures."""

from __future__ import annotations

import contextlib
import hashlib
import json
import operator
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import attrs

from devgraph._errors import DevgraphError
from devgraph._modes import MODE_TABLE, MODES, Mode
from devgraph.runner._rounding import RowCountRounding

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "MODES",
    "MODE_TABLE",
    "Mode",
    "Words",
    "RunnerConfig",
    "RunnerStats",
    "make_config",
    "positive_int",
    "positive_ints",
]


# Converters accept their own output too, so ``attrs.evolve(config, ...)`` works.


def _frozen_map(value: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(dict(value or {}).items()))


def _names(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """A name or names, sorted (one string is one name, not its letters)."""
    return (value,) if isinstance(value, str) else tuple(sorted(value or ()))


def _host_args(value: Any) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, Mapping):
        return tuple(sorted(value.items()))
    return tuple(tuple(item) if isinstance(item, tuple) else (item, item) for item in value)  # type: ignore[misc]


def positive_int(option: str, value: Any) -> int:
    """``value`` as an int when it is one (a Python or NumPy integer, not a bool) and >= 1.

    Raises:
        DevgraphError: naming ``option``, the value and its type (``2.5``, ``"4"`` and ``True`` are
            refused rather than silently turned into 2, 4 and 1).
    """
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            pass
        else:
            if number >= 1:
                return number
    raise DevgraphError(f"{option} must be a positive integer, got {value!r} ({type(value).__name__})")


def positive_ints(option: str, values: Any) -> tuple[int, ...]:
    """Every item of ``values`` through ``positive_int`` (a single int or a string is refused too)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise DevgraphError(f"{option} must be a list of positive integers, got {values!r}")
    return tuple(positive_int(f"every item of {option}", v) for v in values)


def _batch_sizes(value: Any) -> tuple[int, ...] | None:
    return None if value is None else positive_ints("batch_sizes", value)


def _optional_positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        positive_int(attribute.name, value)


def _break_names(value: Any) -> tuple[str, ...]:
    from devgraph.graph import break_names

    return break_names(value)


def _debug_default() -> bool:
    return os.environ.get("DEVGRAPH_DEBUG", "").strip() not in ("", "0", "false", "no")


@attrs.frozen
class Words:
    """How a part is named in messages, the capture summary and the progress bar; and how the bisect
    probes it (``probe``)."""

    kind: str  # the mode's word: "full", "piecewise", "breakable"
    match: str  # what a call is matched against: "captured", "traced"
    sizes: str  # its sizes in messages: "batch sizes", "sizes"
    graphs: str  # what its captures are called in the summary line: "graphs", "breakable graphs"
    desc: str  # the progress bar's word: "capture", "breakable capture"
    serve_what: str  # what could not be done, in ``strict=True`` errors: "from a graph"
    size_options: str  # the options that set its sizes, named when ranks disagree
    remedy: str  # what to do when a size cannot be captured (after the op's own remedy)
    #: how ``devgraph.bisect`` captures a bucket again with its probe: ``"whole"`` (one graph of the
    #: forward per bucket, made by the part's ``make_graph``) or ``"pieces"`` (the traced pieces)
    probe: str = "whole"
    size_noun: str = "batch sizes"  # its sizes, when ranks disagree


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
        debug: verify at replay that inputs and parameters live at their capture addresses (and,
            in piecewise mode, every piece's inputs, not only those that may move).
        warmup_iters: eager runs before each capture.
        mode: "full", "piecewise" or "full_and_piecewise" (see devgraph.compile), "breakable" or
            "full_and_breakable" (see devgraph.graph.BreakableGraph).
        breaks: ops run eagerly between the segment graphs of breakable modes, besides devgraph's
            attention ops and ``devgraph.mark_break``'d ones (``"namespace::op"`` names, checked).
        process_group: the ``torch.distributed`` group whose ranks must capture and replay the same
            sizes (graphs with collectives inside); ``"auto"`` (default): the default group when
            torch.distributed is initialised with more than one rank; None: no rank checks (pass it
            when ranks wrap independent models, data-parallel replicas or a model only one rank
            runs: every rank of the group must capture at the same time).
        check_ranks: ``"capture"`` (default): the ranks agree on their capture sizes once, at
            capture (``RankMismatchError`` otherwise); ``"every_call"``: also on the size each call
            replays (one small all-gather, and a host sync on a device, per call).
        check_padding: run the padding check at capture (``devgraph.runner._padding``: a few eager runs
            per checked bucket that find models whose rows mix or whose outputs are not per row, and
            then serve only exact bucket sizes). False: the caller vouches that rows are independent
            and every output is cut along its batch dim; the Hugging Face adapter's decode step does
            (each row reads and writes only its own cache row; its tests cross buckets).
        capture_context: a callable returning a context manager that the runner enters around the
            capture of every size (warm-ups included), for collectives that need set-up around
            graph capture: an engine's process-group capture context, e.g. vLLM's
            ``lambda: graph_capture(device)`` (its custom all-reduce registers the buffers the
            graphs use when it exits). None: nothing.
    """

    batch_sizes: tuple[int, ...] | None = attrs.field(default=None, converter=_batch_sizes)
    max_batch_size: int | None = attrs.field(default=None, validator=_optional_positive)
    batch_dims: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=_frozen_map)
    static_args: tuple[str, ...] = attrs.field(default=(), converter=_names)
    pad_values: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_frozen_map)
    host_args: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_host_args)
    clone_outputs: bool = False
    strict: bool = False
    debug: bool = attrs.field(factory=_debug_default)
    warmup_iters: int = 2
    mode: str = "full"
    process_group: ProcessGroup | str | None = attrs.field(default="auto", eq=False)
    check_ranks: str = "capture"
    capture_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = attrs.field(
        default=None, eq=False
    )
    check_padding: bool = True
    breaks: tuple[str, ...] = attrs.field(default=(), converter=_break_names)

    def __attrs_post_init__(self) -> None:
        if self.mode not in MODES:
            raise DevgraphError(f"mode must be one of {', '.join(map(repr, MODES))}, got {self.mode!r}")
        if self.breaks and MODE_TABLE[self.mode].serves != "breakable":
            raise DevgraphError(
                f"breaks={list(self.breaks)} applies to mode='breakable' or 'full_and_breakable' only; "
                "add mode=... or drop it (piecewise mode cuts at splitting_ops=[...])"
            )
        if self.check_ranks not in ("capture", "every_call"):
            raise DevgraphError(f"check_ranks must be 'capture' or 'every_call', got {self.check_ranks!r}")
        if self.capture_context is not None and not callable(self.capture_context):
            raise DevgraphError(
                "capture_context must be a callable returning a context manager (e.g. "
                f"lambda: graph_capture(device)), got {self.capture_context!r}"
            )
        if isinstance(self.process_group, str) and self.process_group != "auto":
            raise DevgraphError(
                f"process_group must be a torch.distributed ProcessGroup, 'auto' or None, got {self.process_group!r}"
            )
        if (
            isinstance(self.warmup_iters, bool)
            or not isinstance(self.warmup_iters, int)
            or self.warmup_iters < 0
        ):
            raise DevgraphError(f"warmup_iters must be an integer >= 0, got {self.warmup_iters!r}")

    def check_arguments(self, arguments: Collection[str], what: str = "the model") -> None:
        """Raise when an option names an argument ``what`` does not take (a typo would be ignored).

        Raises:
            DevgraphError: naming the option, the unknown names and the arguments that exist.
        """
        named = {
            "static_args": self.static_args,
            "pad_values": [name for name, _ in self.pad_values],
            "batch_dims": [name for name, _ in self.batch_dims],
            "host_args": [name for name, _ in self.host_args],
        }
        for option, names in named.items():
            unknown = sorted(set(names) - set(arguments))
            if unknown:
                raise DevgraphError(
                    f"{option} names {unknown}, which {what} does not take; it takes: "
                    f"{', '.join(arguments) or 'no named arguments'}"
                )

    def uuid(self) -> str:
        """A stable hash of everything that changes the captured graphs."""
        data = attrs.asdict(self, recurse=True)
        data.pop("debug")  # checks only; captures the same graphs
        data.pop("strict")
        data.pop("check_ranks")  # checks only
        data.pop("process_group")  # a live object (its repr names an address); checks only
        data.pop("capture_context")  # a callable; what it sets up is the caller's
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
    #: captures dropped because a weight, buffer or submodule was replaced since (then captured again)
    recaptures: int = 0
    #: where eager on a call's own rows differs from eager on them padded to a bucket, as measured at
    #: capture on this device (``RowCountRounding``: rows, bucket, largest difference); () where equal
    row_count_rounding: tuple[RowCountRounding, ...] = ()
    #: how the forward was read: ``"raw"``, captured as it runs, untraced (``frontend='raw'``, the
    #: piecewise and breakable modes, the Hugging Face adapter's steps); a ``TracedModule``'s
    #: ``DynamoStats`` says ``"dynamo"``
    frontend: str = "raw"

    def forget_capture(self) -> None:
        """Forget what a capture measured (a part's drop); the counters of calls stay."""
        self.captured_sizes = self.row_count_rounding = ()
        self.pool_bytes, self.capture_seconds = 0, 0.0


class _Config(Protocol):
    """A config whose options name the wrapped function's arguments (``RunnerConfig``)."""

    def check_arguments(self, arguments: Collection[str], what: str = ...) -> None: ...


_ConfigT = TypeVar("_ConfigT", bound=attrs.AttrsInstance)


def make_config(
    cls: type[_ConfigT],
    options: Mapping[str, Any],
    extra_valid: Collection[str] = (),
    what: str = "",
    arguments: Collection[str] | None = None,
) -> _ConfigT:
    """Build the attrs config ``cls`` from ``options``, naming unknown options and the valid ones.

    ``extra_valid`` are names the caller handles itself (listed as valid, not passed to ``cls``).
    ``arguments``: the names the wrapped function takes; options that name arguments
    (``RunnerConfig.check_arguments``) must name some of these (None: it takes any name).

    Raises:
        DevgraphError: an unknown option, a bad value, or an option naming an argument that does not exist.
    """
    valid = [f.name for f in attrs.fields(cls)] + list(extra_valid)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise DevgraphError(f"unknown option(s) {unknown}{what}; valid options: {', '.join(valid)}")
    config = cls(**{k: v for k, v in options.items() if k not in extra_valid})
    if arguments is not None:
        cast(_Config, config).check_arguments(arguments)  # configs given ``arguments`` check them
    return config
