"""NPU (``PrivateUse1``) kernels of the devgraph ops, built from torch_npu ops.

======================== =================================================================
devgraph op              torch_npu
======================== =================================================================
rms_norm                 ``npu_rms_norm(x, weight, epsilon=eps)[0]``
add_rms_norm             ``npu_add_rms_norm`` -> ``(y, rstd, x_sum)``; returns ``(y, x_sum)``
add_rms_norm_quant       ``npu_add_rms_norm`` + ``npu_quantize(y, scale, None, qint8, -1)``
add_rms_norm_dynamic_... ``npu_add_rms_norm`` + ``npu_dynamic_quant(y)`` (fp16/bf16; other
                         dtypes use the reference per-token math, as npu_dynamic_quant takes
                         only fp16/bf16)
split_qkv_rms_norm_rope  ``npu_rms_norm`` on q and k per head + ``npu_rotary_mul`` ("half",
                         neox); partial rotary (rotary_dim < head_dim) uses the reference
                         rotary math. torch_npu has no single op for the whole thing.
paged_decode_attention   ``npu_fused_infer_attention_score.out`` over the paged cache
                         (BNSD query, cache viewed [num_blocks, block_size, Hkv * D])
======================== =================================================================

The quantised ops are compositions, not torch_npu's single fused kernels
(``npu_add_rms_norm_quant`` / ``npu_add_rms_norm_dynamic_quant``): those quantise the float32
norm before rounding it to the input dtype, so they can differ from devgraph's definition by one
int8 step; the composition matches it exactly.

Attention reads its lengths from the host list ``seq_lens_host`` (``actual_seq_lengths_kv``), which
a captured graph freezes: that is why the op is updatable (``NpuDevice.updatable_ops``). Inside
graph work (capture, or a task update) its workspace and softmax-lse buffer are kept per static
shape in the graph's own cache (``graph_work``) and reused, so a task update rewrites the task
with the very buffers captured with it (vllm-ascend keeps its captured workspace for the same
reason), and a graph reset frees them; eager calls let the op allocate.
For the same reason graph work takes ``block_table`` as int32 and a contiguous ``out`` only
(``ValueError`` otherwise): a converted table or a staging output would be a per-call temporary
the task points at, freed as soon as a task update returns while the rewritten task keeps its
address. Eager calls convert both.

While a graph captures an attention task (``launch_sink``), the kernel also hands the graph the one
torch_npu call it launched (``Launch``): a task update whose only new argument is the lengths
re-issues that call with them directly, as vllm-ascend re-issues the parameters it keeps at capture,
instead of running the devgraph op (its checks, views and dispatch) again per layer.

Every kernel imports ``torch_npu`` when it runs: whatever ``sys.modules`` holds then (the real
module, or a stand-in of it such as devgraph's tests' simulator).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

from devgraph.backends import _reference
from devgraph.graph import weak_ref_tensors

__all__ = [
    "KEY",
    "LENGTHS",
    "Launch",
    "attention_lengths",
    "call_signature",
    "graph_work",
    "launch_sink",
    "paged_decode_attention",
    "register_all",
]

KEY = "PrivateUse1"

#: (shapes, dtype) -> (workspace, softmax_lse) of attention: one graph's buffers (``Scratch``).
Scratch = dict[tuple[Any, ...], tuple["torch.Tensor | None", torch.Tensor]]

# The scratch of the graph whose work (capture or task update) is in progress, or None.
_graph_work: contextvars.ContextVar[Scratch | None] = contextvars.ContextVar(
    "devgraph_npu_graph_work", default=None
)


def _torch_npu() -> Any:
    import torch_npu

    return torch_npu


@contextlib.contextmanager
def graph_work(scratch: Scratch) -> Iterator[None]:
    """Mark a graph's capture or task update in progress (``NpuGraph`` does).

    Attention keeps its workspace in ``scratch`` (the graph's own dict): buffers allocated while
    capturing are reused by every task update of that graph, and freed with the graph's dict when
    it is reset, not kept for the life of the process.
    """
    token = _graph_work.set(scratch)
    try:
        yield
    finally:
        _graph_work.reset(token)


#: The host argument of ``devgraph::paged_decode_attention`` a ``Launch`` re-issues directly.
LENGTHS = "seq_lens_host"

# Where the attention kernel hands its launch while a graph captures or re-issues a task, or None.
_launch_sink: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar(
    "devgraph_npu_launch_sink", default=None
)


@attrs.frozen(eq=False)
class Launch:
    """The torch_npu call one attention task launched: re-issued with new lengths, nothing else.

    Tensors are held weakly, as the task group holds its call: the graph (its pool, its scratch)
    keeps their memory, and a launch must not keep capture-time intermediates alive.
    """

    op: Any  # torch_npu's npu_fused_infer_attention_score.out
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    batch: int  # the lengths it takes (the query's batch)
    #: the tensors the kernel was called with (``call_signature``): a graph keeps the launch only
    #: when they are the op call's own, i.e. no kernel registered over this one staged or converted
    #: them (its temporaries would be the task's, and the task would hold more than this launch)
    called_with: tuple[Any, ...]

    def reissue(self, lengths: list[int]) -> None:
        """Launch the call again with ``lengths`` (from ``attention_lengths``) as its kv lengths."""
        self.op(*self.args, **{**self.kwargs, "actual_seq_lengths_kv": lengths})


@contextlib.contextmanager
def launch_sink() -> Iterator[list[Launch]]:
    """Collect the attention launches of the block (an NPU graph opens one per auto task)."""
    sink: list[Launch] = []
    token = _launch_sink.set(sink)
    try:
        yield sink
    finally:
        _launch_sink.reset(token)


def attention_lengths(seq_lens_host: Sequence[int], batch: int) -> list[int]:
    """``seq_lens_host`` as the attention op's ``actual_seq_lengths_kv`` (a list of ``batch`` ints).

    Raises:
        ValueError: it does not list ``batch`` lengths.
    """
    if len(seq_lens_host) != batch:
        raise ValueError(
            f"devgraph.paged_decode_attention: seq_lens_host must list B = {batch} lengths on npu "
            f"(the kernel reads the host lengths: actual_seq_lengths_kv), got {len(seq_lens_host)}"
        )
    return [int(n) for n in seq_lens_host]


#: The tensors of a ``devgraph::paged_decode_attention`` call a launch is checked against.
_CALLED_WITH = ("query", "key_cache", "value_cache", "block_table", "out")


def _signature(tensors: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(
        (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else None
        for t in tensors
    )


def call_signature(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """What a ``Launch`` of this call must have been ``called_with`` (None: not the attention op)."""
    if getattr(func, "_schema", None) is None or func._schema.name != "devgraph::paged_decode_attention":
        return None
    bound = dict(zip((a.name for a in func._schema.arguments), args))
    bound.update(kwargs)
    return _signature([bound.get(name) for name in _CALLED_WITH])


def _keep_launch(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], batch: int, called_with: Sequence[Any]
) -> None:
    sink = _launch_sink.get()
    if sink is None:
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # building the weak tensors is no work of the graph
        weak_args, weak_kwargs = tuple(weak_ref_tensors(list(args))), weak_ref_tensors(kwargs)
    sink.append(Launch(op, weak_args, weak_kwargs, batch, _signature(called_with)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _torch_npu().npu_rms_norm(x, weight, epsilon=eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y, _rstd, x_sum = _torch_npu().npu_add_rms_norm(x, residual, weight, epsilon=eps)
    return y, x_sum


def add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    torch_npu = _torch_npu()
    y, _rstd, x_sum = torch_npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
    q = torch_npu.npu_quantize(y, scale.reshape(1), None, torch.qint8, -1, True)
    return q, x_sum


def add_rms_norm_dynamic_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch_npu = _torch_npu()
    y, _rstd, x_sum = torch_npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
    if y.dtype not in (torch.float16, torch.bfloat16):
        q, scale = _reference.quantize_int8_dynamic(y)
        return q, scale, x_sum
    rows = y.reshape(-1, y.shape[-1])  # npu_dynamic_quant wants at least 2 dims
    q, scale = torch_npu.npu_dynamic_quant(rows)
    scale = scale.reshape(*y.shape[:-1], 1).clamp(min=_reference.MIN_DYNAMIC_SCALE)
    return q.reshape(y.shape), scale, x_sum


def _rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary of ``q[T, Hq, D]`` and ``k[T, Hkv, D]`` by ``npu_rotary_mul`` ("half").

    Partial rotary (``rotary_dim < head_dim``) uses the reference math.
    """
    tokens, head_dim = q.shape[0], q.shape[-1]
    if 2 * cos.shape[-1] != head_dim:
        return _reference.rope_neox(q, k, cos, sin)
    torch_npu = _torch_npu()
    # npu_rotary_mul "half": r1 * x + r2 * cat(-x2, x1), the neox rotation with full-width cos/sin.
    r1 = torch.cat([cos, cos], dim=-1).to(q.dtype).view(1, tokens, 1, head_dim)
    r2 = torch.cat([sin, sin], dim=-1).to(q.dtype).view(1, tokens, 1, head_dim)
    return (
        torch_npu.npu_rotary_mul(q.view(1, *q.shape), r1, r2),
        torch_npu.npu_rotary_mul(k.view(1, *k.shape), r1, r2),
    )


def split_qkv_rms_norm_rope(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's split and layout (its arguments) with torch_npu's RMSNorm and rotary."""
    return _reference.split_qkv_rms_norm_rope(*args, norm=rms_norm, rope=_rope)


def _in_graph_work(torch_npu: Any) -> bool:
    """True while the work is captured into a graph or re-issued by a task update."""
    return _graph_work.get() is not None or bool(torch_npu.npu.is_current_stream_capturing())


def _attention_scratch(
    torch_npu: Any, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any], in_graph: bool
):
    """(workspace, softmax_lse) for one attention call: the graph's own in graph work, else fresh.

    A capture devgraph does not drive (no ``graph_work``) gets buffers of its own per call.
    """
    query = args[0]
    if not in_graph:
        return None, torch.empty(1, dtype=torch.float32, device=query.device)
    cache = _graph_work.get()
    scratch = cache.get(key) if cache is not None else None
    if scratch is None:
        workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(*args, **kwargs)
        scratch = (workspace, torch.empty(1, dtype=torch.float32, device=query.device))
        if cache is not None:
            cache[key] = scratch
    return scratch


#: Query dtypes devgraph's NPU attention accepts: npu_fused_infer_attention_score takes float16 /
#: bfloat16 / int8 queries, and int8 needs quantisation scales devgraph does not pass.
ATTENTION_DTYPES = (torch.float16, torch.bfloat16)


def _check_attention_rules(query: torch.Tensor, key_cache: torch.Tensor, block_size: int) -> None:
    """Refuse, with the remedy, what npu_fused_infer_attention_score refuses on Ascend hardware."""
    if query.dtype not in ATTENTION_DTYPES or key_cache.dtype != query.dtype:
        raise ValueError(
            f"devgraph.paged_decode_attention on npu: query {query.dtype} / kv cache {key_cache.dtype}; "
            "npu_fused_infer_attention_score takes float16 or bfloat16 (float32 fails on Ascend). Run "
            "the model in torch.bfloat16 or torch.float16 (e.g. DecoderConfig(dtype=torch.bfloat16))"
        )
    if block_size % 16 or not 0 < block_size <= 512:
        raise ValueError(
            f"devgraph.paged_decode_attention on npu: block_size {block_size}; page attention needs a "
            "multiple of 16 of at most 512 for float16/bfloat16 caches (128 recommended)"
        )


def paged_decode_attention(*op_args: Any, **op_kwargs: Any) -> None:
    """Attends over ``seq_lens_host`` (host list) tokens per sequence; ``seq_lens`` is not read.

    Arguments: ``_reference.PagedAttentionArgs``. No sliding window and no logit soft-capping
    (``UNSUPPORTED_ARGUMENTS``): refused, see there.
    """
    call = _reference.PagedAttentionArgs(*op_args, **op_kwargs)
    query, key_cache, value_cache, block_table = call[:4]
    sliding_window, logits_soft_cap, out = call.sliding_window, call.logits_soft_cap, call.out
    if sliding_window > 0 or logits_soft_cap > 0:
        raise ValueError(
            f"devgraph.paged_decode_attention on npu: sliding_window={sliding_window}, "
            f"logits_soft_cap={logits_soft_cap}; devgraph's NPU kernel (npu_fused_infer_attention_score) "
            "does not implement sliding windows or logit soft-capping (the op has no soft cap, and "
            "devgraph has not validated its pre_tokens window against Ascend hardware). Run such "
            "models without FULL graphs on npu (PIECEWISE, or the engine's own attention)"
        )
    torch_npu = _torch_npu()
    batch, heads, dim = query.shape
    num_blocks, block_size, kv_heads, _ = key_cache.shape
    lengths = attention_lengths(call.seq_lens_host, batch)
    _check_attention_rules(query, key_cache, block_size)
    in_graph = _in_graph_work(torch_npu)
    if block_table.dtype != torch.int32:
        if in_graph:
            raise ValueError(
                f"devgraph.paged_decode_attention: block_table is {block_table.dtype}; inside graph "
                "capture or a task update on npu it must be torch.int32, because a converted copy "
                "would be a temporary the captured attention task points at (freed when a task update "
                "returns: use-after-free at replay). Pass block_table as int32 (NPU's native index "
                "dtype): build it with dtype=torch.int32 before capture"
            )
        block_table = block_table.to(torch.int32)  # eager only: the op's page table is int32
    if in_graph and not out.is_contiguous():
        raise ValueError(
            f"devgraph.paged_decode_attention: out (shape {tuple(out.shape)}, stride {out.stride()}) "
            "is not contiguous; inside graph capture or a task update on npu the attention task "
            "writes out directly, and a staging buffer would be a temporary freed when a task update "
            "returns (use-after-free at replay). Pass a contiguous out (out=None allocates one), and "
            "copy it into a strided tensor outside the captured region if you need one"
        )
    args = (
        query.unsqueeze(2),  # BNSD: [B, Hq, S=1, D]
        key_cache.view(num_blocks, block_size, kv_heads * dim),
        value_cache.view(num_blocks, block_size, kv_heads * dim),
    )
    kwargs = dict(
        actual_seq_lengths_kv=lengths,
        block_table=block_table,
        num_heads=heads,
        num_key_value_heads=kv_heads,
        scale=float(call.scale),
        input_layout="BNSD",
        block_size=block_size,
    )
    key = (query.device, query.dtype, tuple(query.shape), tuple(key_cache.shape), tuple(block_table.shape))
    workspace, lse = _attention_scratch(torch_npu, key, args, kwargs, in_graph)
    # Eager only (graph work requires a contiguous out): stage a strided out through a buffer.
    target = out.unsqueeze(2) if out.is_contiguous() else torch.empty_like(args[0])
    op = torch_npu.npu_fused_infer_attention_score.out
    kwargs.update(workspace=workspace, out=[target, lse])
    op(*args, **kwargs)
    if in_graph:
        _keep_launch(op, args, kwargs, batch, (query, key_cache, value_cache, block_table, out))
    if not out.is_contiguous():
        out.copy_(target.squeeze(2))


#: Arguments of ``devgraph::paged_decode_attention`` this kernel refuses when set (engine adapters
#: read it through ``devgraph.ops.unsupported_arguments`` to refuse such models at start).
UNSUPPORTED_ARGUMENTS = ("sliding_window", "logits_soft_cap")
paged_decode_attention.unsupported_arguments = UNSUPPORTED_ARGUMENTS  # type: ignore[attr-defined]


def register_all(register: Callable[[str, str, Callable[..., Any]], None]) -> None:
    """Register every NPU kernel: ``register(op_name, "PrivateUse1", kernel)``."""
    register("rms_norm", KEY, rms_norm)
    register("add_rms_norm", KEY, add_rms_norm)
    register("add_rms_norm_quant", KEY, add_rms_norm_quant)
    register("add_rms_norm_dynamic_quant", KEY, add_rms_norm_dynamic_quant)
    register("split_qkv_rms_norm_rope", KEY, split_qkv_rms_norm_rope)
    register("paged_decode_attention", KEY, paged_decode_attention)
