"""``TracedModule``: what ``devgraph.wrap(model)`` returns in ``mode='full'``, the model compiled by
Dynamo with devgraph's backend (``devgraph.frontend._dynamo``) behind it."""

from __future__ import annotations

import copy
import inspect
import threading
from typing import Any

import torch

from devgraph._errors import DevgraphError
from devgraph.frontend._dynamo import DynamoGraphs, DynamoStats, backend_for, call_traced
from devgraph.frontend._traced_graph import PYTHON_RANDOM
from devgraph.runner import (
    GraphedModule,
    RunnerConfig,
    ThreadOwner,
    capture_warnings,
    signature_of,
)

__all__ = ["TracedModule", "wrap_traced"]

#: whether this torch's ``torch.compile`` keeps a compile's cache entries apart (torch >= 2.13)
_ISOLATES = "isolate_recompiles" in inspect.signature(torch.compile).parameters


class TracedModule(GraphedModule):
    """What ``devgraph.wrap(model)`` returns in ``mode='full'`` (``frontend='dynamo'``, the default):
    ``model`` compiled by Dynamo with devgraph as its backend, every tensor argument's batch dimension
    marked dynamic (``static_args`` excepted).

    Callable like the model, with ``GraphedModule``'s surface (``eval()``, ``to()``,
    ``load_state_dict()``, copies and pickling: the options travel, never the graphs). ``stats`` adds
    up every graph Dynamo handed over (``DynamoStats``), with ``eager_calls`` also counting the calls
    Dynamo ran without any graph (its recompile limit reached: one warning names the guard that kept
    failing). ``graphs`` is the backend (every graph's runner in ``graphs.runners``); ``compiled`` the
    ``torch.compile``'d model; ``reset()`` drops every capture.
    """

    def __init__(
        self,
        module: Any,
        graphs: DynamoGraphs,
        options: dict[str, Any],
        fullgraph: bool = False,
        caller_serialises: bool = False,
    ) -> None:
        self.module = module
        self.graphs = graphs
        #: the options ``wrap`` was given (a copy of the wrapper is built from them)
        self._options = options
        self._fullgraph = fullgraph
        # Dynamo keeps one cache per code object: without isolation every wrapper of the same class
        # (eight nn.Linear, a model wrapped again) counts against one recompile limit, and wrappers
        # past it would run eagerly. torch 2.13 isolates a compile's entries when asked.
        isolate: dict[str, Any] = {"isolate_recompiles": True} if _ISOLATES else {}
        self.compiled = torch.compile(module, backend=graphs, fullgraph=fullgraph, **isolate)  # type: ignore[call-overload]
        graphs.eager_on_python_random = True
        graphs.caller_serialises = True  # this wrapper's one thread owner serves every graph
        #: the calls no graph served at all (Dynamo ran them as Python, or devgraph ran the model)
        self._accounts = graphs.accounts
        #: the forward's positional parameter names (a positional argument's ``batch_dims`` key)
        self._positional = _positional_names(module)
        #: whether the model's training-mode layers were looked at since the graphs were last dropped
        self._checked = False
        #: the one live thread served while outputs are views of graph memory (every graph's: a second
        #: thread's call of any of them is refused, as one runner's is)
        self._threads = ThreadOwner(graphs.config, caller_serialises=caller_serialises)
        self._claiming = threading.Lock()

    @property
    def device(self) -> Any:
        return self.graphs.device

    @property
    def stats(self) -> DynamoStats:  # type: ignore[override]
        return self.graphs.stats

    @property
    def captured(self) -> bool:
        """Whether any graph Dynamo handed over holds captures."""
        return any(runner.captured for runner in self.graphs.runners)

    def note_fallback(self, reason: str, detail: str) -> None:
        """Count a call the wrapper's owner ran eagerly (by ``reason``; warned once, raised when
        ``strict``), as ``GraphRunner.note_fallback`` does."""
        self._accounts.note_fallback(reason, detail)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Serve one call through Dynamo (see the class docstring).

        Raises:
            DevgraphError: a call from a second live thread while outputs are views of graph memory
                (``clone_outputs=False``).
        """
        with self._claiming:
            self._threads.claim()
        return self._serve(args, kwargs)

    def _serve(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._checked:
            self._checked = True
            capture_warnings(self.module, self._accounts.warned, hooks=False)
        mark = torch._dynamo.maybe_mark_dynamic
        dims, unbatched, positional = self.graphs.batch_dims, self.graphs.unbatched, self._positional
        for i, a in enumerate(args):
            name = positional[i] if i < len(positional) else ""
            if isinstance(a, torch.Tensor) and a.dim() and name not in unbatched:
                mark(a, dims.get(name, 0))
        for name, a in kwargs.items():
            if isinstance(a, torch.Tensor) and a.dim() and name not in unbatched:
                mark(a, dims.get(name, 0))
        if self.graphs.python_random:  # Dynamo would replay a Python random draw wrongly: eager
            self._accounts.note_fallback("python_random", PYTHON_RANDOM)
            return self.module(*args, **kwargs)
        before = self.graphs.served
        try:
            out = call_traced(self.graphs, self.compiled, *args, **kwargs)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as why:
            if not self._fullgraph:
                raise
            first = str(why).strip().splitlines()[0]
            raise DevgraphError(
                f"fullgraph=True: Dynamo cannot trace {type(self.module).__name__}'s forward as one graph: "
                f"{first}. Drop fullgraph to run that code eagerly between graphs (counted in "
                "stats.graph_breaks), or change the forward (Dynamo's message has a hint)"
            ) from why
        if self.graphs.served == before:
            self._note_untraced()
        return out

    def capture(self, *example_args: Any, **example_kwargs: Any) -> TracedModule:
        """Trace and capture every bucket now, by calling the model once with an example (any batch
        size): unlike ``frontend='raw'``, that is a call, and its Python side effects happen."""
        self._serve(example_args, example_kwargs)  # its outputs are dropped: no thread holds them
        return self

    def _note_untraced(self) -> None:
        """A call no graph of devgraph's served: Dynamo ran it as Python (past its recompile limit,
        or a frame it skips)."""
        self._accounts.note_fallback("dynamo_untraced", _untraced_message(self.module))

    def reset(self) -> None:
        """Drop every capture; Dynamo's traces stay (the next call of each graph captures again)."""
        self._drop_graphs()

    def _drop_graphs(self) -> None:
        self.graphs.reset()
        self._checked = False

    def __deepcopy__(self, memo: dict[int, Any]) -> TracedModule:
        return wrap_traced(copy.deepcopy(self.module, memo), self.device, self._options)

    def __copy__(self) -> TracedModule:
        return wrap_traced(self.module, self.device, self._options)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (``pickle``, ``torch.save``) as the model, the device and the options."""
        return (_unpickle, (self.module, self.device.torch_device, self._options))

    def __repr__(self) -> str:
        return (
            f"<devgraph TracedModule {type(self.module).__name__} on {self.device}, "
            f"{len(self.graphs.runners)} graph(s)>"
        )


def _unpickle(module: Any, device: Any, options: dict[str, Any]) -> TracedModule:
    from devgraph._plugins import device as find_device

    return wrap_traced(module, find_device(device), options)


def _untraced_message(module: Any) -> str:
    from torch._dynamo.utils import guard_failures

    reasons = [
        f"{getattr(code, 'co_name', code)}: {found[-1]}"
        for code, found in list(guard_failures.items())[-3:]
        if found
    ]
    why = f" (the guard that kept failing: {'; '.join(reasons)})" if reasons else ""
    return (
        f"a call of {type(module).__name__} ran without graphs: Dynamo ran it as Python, past its recompile "
        f"limit or in a frame it skips{why}; a value that changes every call and is read by the forward "
        "makes Dynamo trace again each time"
    )


def _positional_names(model: Any) -> tuple[str, ...]:
    try:
        params = signature_of(model).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def wrap_traced(
    model: Any, device: Any, options: dict[str, Any], *, caller_serialises: bool = False
) -> TracedModule:
    """``devgraph.wrap(model, device, **options)`` in ``mode='full'`` (see ``TracedModule``).

    ``batch_dims``, ``static_args`` and ``pad_values`` name the forward's arguments; devgraph finds
    them in each graph Dynamo hands over. ``fullgraph=True`` refuses a graph break (a
    ``DevgraphError`` at the call that traces it) instead of running the code there eagerly.
    ``caller_serialises``: the caller keeps one call in flight and reads the outputs before the next
    (an adapter's step under its own lock): no thread owner is claimed.

    Raises:
        DevgraphError: ``host_args`` (served by ``frontend='raw'`` only), ``batch_dims``,
            ``static_args`` or ``pad_values`` naming an argument the forward does not take, a dim
            that is not an int >= 0; what ``backend_for`` raises.
    """
    kept = dict(options)
    options = dict(options)
    if options.get("host_args"):
        raise DevgraphError(
            f"host_args={options['host_args']!r}: a host list through Dynamo is a constant of its graph "
            "(one graph per value), so devgraph serves host arguments without Dynamo only. Pass "
            "frontend='raw' (the forward captured untraced: you promise it reads and changes no Python "
            "state), in mode='full' or with mode='breakable' and breaks=[...] at the ops that read them"
        )
    options.pop("host_args", None)
    fullgraph = options.pop("fullgraph", False)
    if not isinstance(fullgraph, bool):
        raise DevgraphError(f"fullgraph must be True or False, got {fullgraph!r}")
    named = RunnerConfig(
        batch_dims=options.pop("batch_dims", None) or {},
        static_args=options.pop("static_args", None) or (),
        pad_values=options.pop("pad_values", None) or {},
    )
    batch_dims = dict(named.batch_dims)
    graphs = backend_for({**options, "device": device})
    graphs.batch_dims = batch_dims
    graphs.unbatched = frozenset(named.static_args)
    graphs.pad_values = dict(named.pad_values)
    try:
        params = list(signature_of(model).parameters.values())
    except (TypeError, ValueError):
        params = None
    graphs.var_keyword = next((p.name for p in params or () if p.kind == p.VAR_KEYWORD), None)
    if params is not None and graphs.var_keyword is None:  # **kwargs takes any name (passed through)
        named.check_arguments([p.name for p in params])
    bad = {k: v for k, v in batch_dims.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0}
    if bad:
        raise DevgraphError(f"batch_dims must map argument names to dims (ints >= 0), got {bad}")
    return TracedModule(model, graphs, kept, fullgraph, caller_serialises)
