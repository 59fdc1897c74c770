"""devgraph's compiler for ``torch.compile`` and the one-shot trace the piecewise runner does with it.

``DevgraphCompiler`` is a Dynamo backend (torch's word; in devgraph a backend is a device plugin). It lowers Dynamo's graph to aten ops (``make_fx`` over
Dynamo's fake inputs, *without* functionalization, so in-place ops stay where the model put them),
binds host-list arguments to run-time values, runs the ``PassManager``, cuts the graph at the
splitting ops, compiles every piece with the chosen compiler (``compile_backend``) and returns a
``PiecewiseModule``. Used directly (``torch.compile(model, backend=DevgraphCompiler(...))``) it
gives split, fused, compiled pieces without graph capture.

``trace_call`` is how the piecewise runner uses it: one trace with the token dimension marked
dynamic, after which the runner calls the ``PiecewiseModule`` itself, bypassing Dynamo's guards
(as vLLM does), so calls of any size reuse one graph.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import TreeSpec, tree_flatten

from devgraph._errors import CaptureError, DevgraphError
from devgraph._plugins import device as _device
from devgraph.compile._compilers import CompiledPiece, compile_piece
from devgraph.compile._config import CompileConfig
from devgraph.compile._guards import check_token_guards, guards_hold, symbolic_sizes, token_guards
from devgraph.compile._pieces import PiecewiseModule
from devgraph.compile._split import SplitGraph, split_graph
from devgraph.compile._splitting_ops import (
    SYM_OPS,
    bind_host_args,
    is_host_arg_node,
    keep_composite_ops_whole,
)
from devgraph.graph import Device

__all__ = [
    "CompiledGraph",
    "DevgraphCompiler",
    "InputSlot",
    "OutputSlot",
    "Traced",
    "lower_to_aten",
    "trace_call",
]

logger = logging.getLogger("devgraph.compile")


@attrs.frozen
class CompiledGraph:
    """What ``DevgraphCompiler`` built from one Dynamo graph.

    Attributes:
        module: the split, compiled model (see ``PiecewiseModule``).
        graph: the aten graph after the passes, before the split (for inspection).
        split: the split graph and its pieces.
        example_inputs: Dynamo's real example inputs of the tensor placeholders, in order.
        symint_positions: positions of SymInt arguments in Dynamo's calling convention (dropped).
        fake_inputs: fake (symbolic) values of the tensor placeholders.
        fake_outputs: fake values of the graph's outputs.
        pass_counts: matches each pass rewrote, by pass name.
        compile_seconds: time spent in the compiler.
    """

    module: PiecewiseModule
    graph: fx.GraphModule
    split: SplitGraph
    example_inputs: tuple[torch.Tensor, ...]
    symint_positions: tuple[int, ...]
    fake_inputs: tuple[torch.Tensor, ...]
    fake_outputs: tuple[Any, ...]
    pass_counts: dict[str, int]
    compile_seconds: float


def lower_to_aten(
    gm: fx.GraphModule, fake_inputs: Sequence[Any], fake_mode: FakeTensorMode
) -> fx.GraphModule:
    """``gm`` retraced to aten ops over ``fake_inputs`` (symbolic sizes kept), not functionalized."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_mode, enable_python_dispatcher(), torch.no_grad():
        return make_fx(gm, pre_dispatch=False)(*fake_inputs)


def _replace_symint_placeholders(gm: fx.GraphModule, fakes: Sequence[Any]) -> tuple[int, ...]:
    """Compute each SymInt input from a tensor input's size instead; return their positions."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [(n, f) for n, f in zip(placeholders, fakes) if isinstance(f, torch.Tensor)]
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    dropped = []
    for i, (node, fake) in enumerate(zip(placeholders, fakes)):
        if isinstance(fake, torch.Tensor):
            continue
        if not isinstance(fake, torch.SymInt):
            raise DevgraphError(
                f"the traced graph takes a non-tensor input {node.name} = {fake!r}; piecewise mode supports "
                "tensor inputs (and sizes derived from them) only"
            )
        source = next(
            (
                (t, d)
                for t, f in tensors
                for d, s in enumerate(f.shape)
                if isinstance(s, torch.SymInt) and s.node.expr == fake.node.expr
            ),
            None,
        )
        if source is None:
            raise DevgraphError(f"the traced graph takes a size {fake} that no input tensor has")
        with gm.graph.inserting_before(first):
            size = gm.graph.call_function(torch.ops.aten.sym_size.int, source)
        size.meta["val"] = fake
        node.replace_all_uses_with(size)
        gm.graph.erase_node(node)
        dropped.append(i)
    return tuple(dropped)


def _drop_dead_shape_nodes(gm: fx.GraphModule) -> None:
    """Remove unused size queries (make_fx leaves some); they would pin pattern nodes' users."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and not node.users and node.target in SYM_OPS:
            gm.graph.erase_node(node)


def _propagate(
    gm: torch.nn.Module, fakes: Sequence[Any], fake_mode: FakeTensorMode
) -> dict[str, tuple[Any, ...]]:
    """Run ``gm`` on fakes: refresh ``meta['val']`` and return each submodule's fake inputs."""
    from torch._dispatch.python import enable_python_dispatcher

    seen: dict[str, tuple[Any, ...]] = {}

    class Prop(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            n.meta["val"] = result
            return result

        def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            seen[target] = tuple(args)
            return super().call_module(target, args, kwargs)

    with fake_mode, enable_python_dispatcher(), torch.no_grad():
        Prop(gm).run(*fakes)
    return seen


class DevgraphCompiler:
    """devgraph's compiler, a ``torch.compile`` backend: aten lowering, passes, split at splitting ops,
    per-piece compile.

    Args:
        device: the devgraph device (pass contexts, default compiler); None: the best one.
        config: a ``CompileConfig``.
        host_args: op argument names fed from run-time host lists (``host_arg``) instead of the
            traced values; ``host`` holds the values used when Dynamo runs the result.
    """

    def __init__(
        self, device: Device | None = None, config: CompileConfig | None = None, host_args: Sequence[str] = ()
    ) -> None:
        if device is None:
            device = _device()
        self.device = device
        self.config = config or CompileConfig()
        self.config.check_device(device)
        self.host_args = tuple(host_args)
        self.host: Mapping[str, Sequence[Any]] | None = None  # op argument -> host list
        self.compiled: list[CompiledGraph] = []
        self.last_outputs: Any = None  # the module's outputs of the last run through Dynamo

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        result = self.compile(gm, example_inputs)
        self.compiled.append(result)
        dropped = set(result.symint_positions)
        module = result.module

        def run(*args: Any) -> Any:
            tensors = [a for i, a in enumerate(args) if i not in dropped]
            out = module(*tensors, host=self.host)
            self.last_outputs = out
            return out

        return run

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledGraph:
        """Build a ``CompiledGraph`` from Dynamo's graph and example inputs (inside Dynamo's compile)."""
        from devgraph.compile.passes import PassContext, PassManager, resolve_passes

        start = time.perf_counter()
        _refuse_host_syncs(gm)
        config, device = self.config, self.device
        splitting = config.all_splitting_ops()
        keep_composite_ops_whole(gm, splitting)
        fake_mode = torch._guards.TracingContext.get().fake_mode
        assert fake_mode is not None, "DevgraphCompiler runs inside Dynamo's compile"
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fakes = [
            fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else n.meta.get("example_value", x)
            for n, x in zip(placeholders, example_inputs)
        ]
        aten = lower_to_aten(gm, fakes, fake_mode)
        dropped = _replace_symint_placeholders(aten, fakes)
        _drop_dead_shape_nodes(aten)
        bind_host_args(aten, self.host_args)
        compiler = config.compiler_for(device)
        context = PassContext(device=device, compile_backend=compiler, splitting_ops=splitting)
        manager = PassManager(resolve_passes(config.passes, device), context)
        counts = manager(aten.graph)
        aten.graph.lint()
        aten.recompile()
        tensor_fakes = tuple(f for i, f in enumerate(fakes) if i not in set(dropped))
        _propagate(aten, tensor_fakes, fake_mode)
        split = split_graph(aten, splitting)
        piece_inputs = _propagate(split.module, tensor_fakes, fake_mode)
        compiled: dict[str, CompiledPiece] = {}
        for piece in split.pieces:
            if piece.is_splitting_op:
                continue
            chosen = compiler if piece.does_work else "eager"
            if chosen != "eager":
                _check_compilable(piece.name, piece.graph_module)
            compiled[piece.name] = compile_piece(
                chosen, piece.name, piece.graph_module, piece_inputs[piece.name], device
            )
        module = PiecewiseModule(split, compiled, device)
        output = next(n for n in aten.graph.nodes if n.op == "output")
        fake_outputs = tuple(
            a.meta.get("val") if isinstance(a, fx.Node) else a for a in _flat(output.args[0])
        )
        seconds = time.perf_counter() - start
        logger.info(
            "devgraph: traced %d aten ops, split into %d pieces at %d splitting-op calls (%s), compiled with %s "
            "in %.2f s; pass matches: %s",
            sum(1 for n in aten.graph.nodes if n.op == "call_function"),
            len(split.captured),
            sum(p.is_splitting_op for p in split.pieces),
            ", ".join(splitting),
            compiler,
            seconds,
            ", ".join(f"{k} {v}" for k, v in counts.items()) or "none",
        )
        return CompiledGraph(
            module=module,
            graph=aten,
            split=split,
            example_inputs=tuple(x for i, x in enumerate(example_inputs) if i not in set(dropped)),
            symint_positions=dropped,
            fake_inputs=tensor_fakes,
            fake_outputs=fake_outputs,
            pass_counts=counts,
            compile_seconds=seconds,
        )


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


#: Dynamo graph calls (method or function names) that read device values on the host or make
#: data-dependent shapes: Dynamo traces them (``.item()`` as a SymFloat), a captured piece cannot.
_SHAPE_SYNCS = ("nonzero", "masked_select", "unique", "unique_consecutive")


def _node_source(node: fx.Node) -> str | None:
    """``"file.py:LINE: code"`` of the user line a Dynamo graph node came from (its stack trace)."""
    lines = (node.meta.get("stack_trace") or "").rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].strip()
        if line.startswith('File "'):
            path, _, rest = line[len('File "') :].partition('", line ')
            lineno = rest.split(",")[0]
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{path}:{lineno}: {code}" if code else f"{path}:{lineno}"
    return None


def _refuse_host_syncs(gm: fx.GraphModule) -> None:
    """Raise ``CaptureError`` at the first host sync in Dynamo's graph, naming it and its line.

    Without this the trace fails later, deep in the lowering, with an error that names neither.
    """
    from devgraph.graph import FUNCTION_SYNCS, SHAPE_REMEDY

    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function"):
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if name in FUNCTION_SYNCS and (node.op == "call_method" or "Tensor" in str(node.target)):
            remedy = FUNCTION_SYNCS[name]
        elif name in _SHAPE_SYNCS:
            remedy = SHAPE_REMEDY
        else:
            continue
        raise CaptureError(
            "piecewise mode cannot trace a host synchronisation: the pieces are captured graphs, which "
            "cannot read device values on the host",
            op=f"Tensor.{name}" if node.op == "call_method" else f"torch.{name}",
            source=_node_source(node),
            remedy=remedy,
        )


def _check_compilable(name: str, gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if is_host_arg_node(node):
            user = next(iter(node.users))
            raise DevgraphError(
                f"host argument {node.args[0]!r} reaches {user.target} inside compiled piece {name}; a compiled "
                f"piece cannot take host lists. Add '{user.target._schema.name}' to splitting_ops, or use "
                "compile_backend='eager'"
            )


# -- the runner's trace ------------------------------------------------------------------------

#: Per graph input: ``("arg", name)`` (a call argument) or ``("fixed", tensor)`` (a weight or buffer).
InputSlot = tuple[Literal["arg"], str] | tuple[Literal["fixed"], torch.Tensor]
#: Per output leaf of the model: ``("out", index into the module's outputs)`` or ``("const", value)``.
OutputSlot = tuple[Literal["out"], int] | tuple[Literal["const"], Any]


@attrs.frozen
class Traced:
    """A model traced once and compiled piecewise, with how to call it directly.

    Attributes:
        compiled: the compiler's result.
        inputs: per graph input, ``("arg", name)`` (a call argument) or ``("fixed", tensor)``
            (a weight or buffer the graph reads).
        outputs: per output leaf of the model, ``("out", index into the module's outputs)`` or
            ``("const", value)``.
        spec: the pytree spec of the model's output.
        batch_dims: per module output, the dims that are the traced (token) dimension.
        guards: the trace's decisions on the token count, ``(expression, user line)``
            (``token_guards``): it holds where every expression does.
        symbols: the token dimension's symbols.
        static_size: the token count of a trace without a symbolic token dimension (it holds at
            that count only); None for a symbolic trace.
    """

    compiled: CompiledGraph
    inputs: tuple[InputSlot, ...]
    outputs: tuple[OutputSlot, ...]
    spec: TreeSpec
    batch_dims: tuple[tuple[int, ...], ...]
    guards: tuple[Any, ...] = ()
    symbols: frozenset[Any] = frozenset()
    static_size: int | None = None

    def holds_at(self, tokens: int) -> bool:
        """Whether the compiled pieces compute what the forward does at ``tokens`` tokens: the token
        count the trace branched on goes the traced way there (every guard holds)."""
        if self.static_size is not None:
            return tokens == self.static_size
        return guards_hold(self.guards, self.symbols, tokens)

    @property
    def branch_lines(self) -> tuple[str, ...]:
        """The user lines (``"path:LINE: code"``) where the forward branched on the token count."""
        return tuple(dict.fromkeys(line for _, line in self.guards))

    def check_guards(self, run_sizes: Sequence[int] | None) -> None:
        """Raise ``DevgraphError`` naming the line when the trace fails at one of ``run_sizes`` or
        at a count above the largest (``check_token_guards``; None: at any count)."""
        if self.static_size is None:
            _check_guards(self.compiled, set(self.symbols), run_sizes)


def _traced_function(call: Callable[..., Any]) -> Callable[..., Any]:
    def devgraph_traced(*args: Any) -> Any:
        return call(*args)

    return devgraph_traced


def _fresh_function(call: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling ``call`` whose code object is its own, defined in this file.

    Dynamo caches compiled code per code object and gives up on one after ``recompile_limit``
    (8) entries, so a code object shared by every trace would fail the ninth model traced in a
    process. The copy keeps this file as its source: torch 2.11's ``torch.compile`` routes a
    function without a source file (``exec``'d code) through one shared wrapper frame of its own
    (``external_utils.inner``), which would share its cache again.
    """
    fn = _traced_function(call)
    fn.__code__ = fn.__code__.replace()  # replace() always builds a new code object
    return fn


def _pins_a_size(exc: BaseException) -> bool:
    """Whether Dynamo refused the trace because the code made a dimension marked dynamic a constant."""
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    seen: BaseException | None = exc
    for _ in range(8):  # Dynamo's wrappers: inner_exception, __cause__
        if seen is None or isinstance(seen, ConstraintViolationError):
            break
        seen = getattr(seen, "inner_exception", None) or seen.__cause__
    return isinstance(seen, ConstraintViolationError)


def _unwrap_dynamo_error(exc: BaseException) -> BaseException:
    inner = getattr(exc, "inner_exception", None)
    return inner if isinstance(inner, DevgraphError) else exc


def trace_call(
    invoke: Callable[[dict[str, torch.Tensor], bool], Any],
    tensors: dict[str, torch.Tensor],
    dynamic: Mapping[str, int],
    compiler: DevgraphCompiler,
    host: Mapping[str, Sequence[Any]],
    run_sizes: Sequence[int] | None = None,
    *,
    check_guards: bool = True,
    static_size: int | None = None,
    static_if_pinned: bool = False,
) -> Traced:
    """Trace ``invoke(tensors, traced)`` once with Dynamo and ``compiler``; return how to call it directly.

    ``invoke(tensors, traced)`` calls the model; with ``traced`` it must pass empty host lists.
    ``dynamic`` maps argument names to their token dimension. ``host`` (op argument -> list) is
    what the host arguments are when Dynamo runs the result once. ``run_sizes`` are the token counts
    the result runs at, besides every count above the largest (None: every count); a forward that
    branches on the token count differently at one of them is refused (``check_token_guards``)
    unless ``check_guards`` is False (the caller then serves only counts where ``Traced.holds_at``).
    ``static_size``: trace without a symbolic token dimension, the tensors holding that many tokens
    (``dynamic`` and the guard check are ignored): every decision on the token count, torch's own
    0/1 specialisations included, is then made for that count exactly. ``static_if_pinned``: when
    the forward pins the token count to the traced one (``if x.shape[0] == 2:`` traced at 2, which
    Dynamo refuses for a dynamic dimension), trace statically at that count instead of refusing.
    """
    if static_size is not None:
        # New tensor objects over the same memory: Dynamo keeps dynamic marks on the tensors it saw.
        tensors = {n: t.view(t.shape) if n in dynamic else t for n, t in tensors.items()}
        dynamic, check_guards = {}, False
    names = list(tensors)
    with torch.no_grad():
        reference = invoke(tensors, False)  # the output's structure (and a warm-up)
    ref_leaves, spec = tree_flatten(reference)

    def call(*args: torch.Tensor) -> tuple[Any, ...]:
        return tuple(tree_flatten(invoke(dict(zip(names, args)), True))[0])

    args = [tensors[n] for n in names]
    for name, dim in dynamic.items():
        torch._dynamo.mark_dynamic(tensors[name], dim)
    compiler.host = host
    compiled_fn = torch.compile(_fresh_function(call), backend=compiler, fullgraph=True, dynamic=False)
    sizes = symbolic_sizes() if dynamic else contextlib.nullcontext()
    try:
        with torch.no_grad(), sizes:
            leaves = compiled_fn(*args)
    except DevgraphError:
        raise
    except Exception as exc:
        if static_if_pinned and dynamic and _pins_a_size(exc):
            name, dim = next(iter(dynamic.items()))
            return trace_call(
                invoke, tensors, dynamic, compiler, host, run_sizes, static_size=tensors[name].shape[dim]
            )
        inner = _unwrap_dynamo_error(exc)
        if inner is not exc:
            raise inner from None
        # Dynamo wraps a backend's error (BackendCompilerFailed): its own first line names only the
        # backend, so report the backend's error itself.
        cause = getattr(exc, "inner_exception", None) or exc
        text = f"{type(cause).__name__}: {cause}".strip()
        first = next((line for line in text.splitlines() if line.strip()), type(cause).__name__)
        raise DevgraphError(
            f"piecewise mode could not trace the model as one graph with Dynamo: {first}. "
            "Piecewise mode needs a forward Dynamo traces without graph breaks, whose token dimension stays "
            "symbolic (no Python branching on it). Use mode='full', or see TORCH_LOGS=graph_breaks,dynamic"
        ) from exc
    finally:
        compiler.host = None
    if not compiler.compiled:
        raise DevgraphError("Dynamo did not call devgraph's compiler (was the model already compiled?)")
    result = compiler.compiled[-1]
    module_outputs = _flat(compiler.last_outputs)
    outputs: list[OutputSlot] = []
    for leaf, ref in zip(leaves, ref_leaves):
        if isinstance(leaf, torch.Tensor):
            index = next((k for k, o in enumerate(module_outputs) if o is leaf), None)
            if index is None:
                raise DevgraphError(
                    "an output of the model is not computed by the traced graph (an input returned as is?); "
                    "piecewise mode needs every output tensor computed in the forward"
                )
            outputs.append(("out", index))
        else:
            outputs.append(("const", ref))
    inputs: list[InputSlot] = []
    for example in result.example_inputs:
        arg_name = next((n for n, t in zip(names, args) if t is example), None)
        inputs.append(("arg", arg_name) if arg_name is not None else ("fixed", example))
    symbols = set()
    for n, fake in _fakes_by_name(result, inputs).items():
        token_dim: object = fake.shape[dynamic[n]] if n in dynamic else None  # a SymInt if dynamic
        if isinstance(token_dim, torch.SymInt):
            symbols.add(token_dim.node.expr)
    if check_guards:
        _check_guards(result, symbols, run_sizes)
    batch_dims = tuple(
        tuple(
            d
            for d, s in enumerate(getattr(f, "shape", ()))
            if isinstance(s, torch.SymInt) and s.node.expr in symbols
        )
        for f in result.fake_outputs
    )
    _check_output_shapes(result.fake_outputs, symbols)
    shape_env = _shape_env(result)
    guards = token_guards(shape_env, symbols) if shape_env is not None else ()
    return Traced(
        result, tuple(inputs), tuple(outputs), spec, batch_dims, guards, frozenset(symbols), static_size
    )


def _shape_env(result: CompiledGraph) -> Any:
    """The trace's ``ShapeEnv`` (None when no input size is symbolic)."""
    # A fake tensor's sizes are SymInts where symbolic (torch types them int).
    sizes: Iterator[object] = (s for f in result.fake_inputs for s in f.shape)
    sym = next((s for s in sizes if isinstance(s, torch.SymInt)), None)
    return None if sym is None else sym.node.shape_env


def _check_guards(result: CompiledGraph, symbols: set[Any], run_sizes: Sequence[int] | None) -> None:
    """Refuse a trace that holds for some of the token counts it runs at only (``check_token_guards``)."""
    shape_env = _shape_env(result)
    if shape_env is not None:
        check_token_guards(shape_env, symbols, run_sizes)


def _check_output_shapes(fakes: Sequence[Any], symbols: set[Any]) -> None:
    """Raise when an output's size depends on the token count other than *as* a dim of it.

    Outputs are cut from the padded size back to the call's token count along the token dims; a
    dim like ``tokens * hidden`` (a flattened output) or ``tokens - 1`` cannot be cut that way, and
    the call would get padding rows back.
    """
    for index, fake in enumerate(fakes):
        for d, s in enumerate(getattr(fake, "shape", ())):
            if not isinstance(s, torch.SymInt) or s.node.expr in symbols:
                continue
            if s.node.expr.free_symbols & symbols:
                raise DevgraphError(
                    f"output {index} of the model has shape {tuple(fake.shape)}: dim {d} ({s}) depends on the "
                    "token count without being it, so piecewise mode cannot cut it back from the padded "
                    "size. Return outputs with the token count as a dim of its own (reshape outside the "
                    "model), or use mode='full'"
                )


def _fakes_by_name(result: CompiledGraph, inputs: Sequence[InputSlot]) -> dict[str, torch.Tensor]:
    return {slot[1]: fake for slot, fake in zip(inputs, result.fake_inputs) if slot[0] == "arg"}
