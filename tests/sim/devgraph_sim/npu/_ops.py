"""Reference (CPU) implementations of the torch_npu ops the NPU backend calls, for the simulator.

Each op is a real dispatcher op defined with ``torch.library`` under the private namespace
``devgraph_npu_sim`` with the schema torch_npu 2.13.0 registers (copied from ``libtorch_npu.so``
and ``npu_native_functions_by_codegen.yaml``; ``tests/backends/npu/test_npu_signatures.py`` checks them against
the wheel). Being dispatcher ops matters: graph capture and torch_npu's ``auto_dispatch_capture``
mode see them as one call each, under the same ``func.__name__`` (``"npu_rms_norm.default"``) as
on hardware. The namespace is private (not ``npu``) so a real torch_npu loaded later in the same
process can still register its own ``npu`` library.

The math follows the torch_npu documentation; features the simulator does not model (quantised
attention, rope, shared prefixes...) raise ``NotImplementedError`` naming the argument instead of
computing something else.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["NAMESPACE", "check_call", "define_ops", "op"]

NAMESPACE = "devgraph_npu_sim"

_IFA_KWARGS = (
    "Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, "
    "SymInt[]? actual_seq_lengths_kv=None, Tensor? dequant_scale1=None, Tensor? quant_scale1=None, "
    "Tensor? dequant_scale2=None, Tensor? quant_scale2=None, Tensor? quant_offset2=None, "
    "Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, "
    "Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, "
    "Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? query_padding_size=None, "
    "Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, "
    "SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, "
    "Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, "
    'int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", '
    "int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, "
    "int antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, "
    "bool softmax_lse_flag=False"
)

#: name -> schema, as torch_npu 2.13.0 registers them (``.out`` folds its outputs into ``Tensor[] out``).
SCHEMAS: dict[str, str] = {
    "npu_fused_infer_attention_score": (
        f"(Tensor query, Tensor key, Tensor value, *, {_IFA_KWARGS}) -> (Tensor, Tensor)"
    ),
    "npu_fused_infer_attention_score.out": (
        f"(Tensor query, Tensor key, Tensor value, *, {_IFA_KWARGS}, Tensor? workspace=None, "
        "Tensor[] out) -> (Tensor, Tensor)"
    ),
    "_npu_fused_infer_attention_score_get_max_workspace": (
        f"(Tensor query, Tensor key, Tensor value, *, {_IFA_KWARGS}) -> Tensor"
    ),
    "_npu_fused_infer_attention_score_infer_output": (
        '(Tensor query, Tensor value, *, str input_layout="BSH", Tensor? quant_scale2=None, '
        "Tensor? block_table=None, int num_heads=1, int num_key_value_heads=0, "
        "bool softmax_lse_flag=False, Tensor? query_rope=None) -> (Tensor, Tensor)"
    ),
    # ATB op (torch.ops.atb on hardware); schema reconstructed from the C++ symbol, see npu_api notes.
    "_npu_paged_attention": (
        "(Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, int num_heads, "
        "float scale_value, Tensor block_table, Tensor context_lens, Tensor(a!) out, *, "
        "Tensor? workspace=None) -> ()"
    ),
    "npu_rms_norm": "(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_add_rms_norm": (
        "(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)"
    ),
    "npu_quantize": (
        "(Tensor input, Tensor scales, Tensor? zero_points, int dtype, int axis=1, bool div_mode=True) "
        "-> Tensor"
    ),
    "npu_dynamic_quant": (
        "(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, int? dst_type=None, "
        'str quant_mode="pertoken", float dst_type_max=0.0) -> (Tensor, Tensor)'
    ),
    "npu_rotary_mul": (
        "(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor"
    ),
}

_lock = threading.Lock()
_lib: torch.library.Library | None = None


def op(name: str) -> Any:
    """The OpOverloadPacket of simulated op ``name`` (``define_ops()`` must have run)."""
    return getattr(getattr(torch.ops, NAMESPACE), name)


def define_ops() -> None:
    """Define the simulated ops once per process (idempotent; the definitions are never removed)."""
    global _lib
    with _lock:
        if _lib is not None:
            return
        lib = torch.library.Library(NAMESPACE, "DEF")
        for name, schema in SCHEMAS.items():
            lib.define(name + schema)
        for name, kernel in _KERNELS.items():
            lib.impl(name, kernel, "CPU")
        _lib = lib


# -- attention -----------------------------------------------------------------------------------

_UNMODELLED_IFA = (
    "pse_shift",
    "dequant_scale1",
    "quant_scale1",
    "dequant_scale2",
    "quant_scale2",
    "quant_offset2",
    "antiquant_scale",
    "antiquant_offset",
    "key_antiquant_scale",
    "key_antiquant_offset",
    "value_antiquant_scale",
    "value_antiquant_offset",
    "query_padding_size",
    "kv_padding_size",
    "key_shared_prefix",
    "value_shared_prefix",
    "actual_shared_prefix_len",
    "query_rope",
    "key_rope",
    "key_rope_antiquant_scale",
)

#: input_layout -> (query layout, output layout) for the layouts the simulator models.
_LAYOUTS = {
    "BSH": ("BSH", "BSH"),
    "BSND": ("BSND", "BSND"),
    "BNSD": ("BNSD", "BNSD"),
    "BNSD_BSND": ("BNSD", "BSND"),
}
_RANK = {"BSH": 3, "BSND": 4, "BNSD": 4}


def _fail(message: str) -> None:
    raise RuntimeError(f"npu_fused_infer_attention_score (simulated): {message}")


def _to_bnsd(x: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """``x`` in ``layout`` as [B, N, S, D]."""
    if layout == "BSH":
        b, s, h = x.shape
        if h % heads:
            _fail(f"hidden size {h} is not a multiple of the head count {heads}")
        return x.view(b, s, heads, h // heads).transpose(1, 2)
    if layout == "BSND":
        return x.transpose(1, 2)
    return x


def _from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BSH":
        b, n, s, d = x.shape
        return x.transpose(1, 2).reshape(b, s, n * d)
    if layout == "BSND":
        return x.transpose(1, 2)
    return x


def _kv_heads(num_heads: int, num_key_value_heads: int) -> int:
    nkv = num_key_value_heads or num_heads
    if num_heads <= 0 or num_heads % nkv:
        _fail(f"num_heads ({num_heads}) must be a positive multiple of num_key_value_heads ({nkv})")
    return nkv


def _paged_kv(cache: torch.Tensor, nkv: int, block_size: int) -> torch.Tensor:
    """A KV cache in either paged shape as [num_blocks, block_size, N_kv, D]."""
    if cache.dim() == 3:
        nb, bs, h = cache.shape
        kv = cache.view(nb, bs, nkv, h // nkv)
    elif cache.dim() == 4:
        kv = cache.transpose(1, 2)  # (blocknum, KV_N, blocksize, D)
    else:
        _fail(f"with block_table the key/value cache must be 3-D or 4-D, got {cache.dim()}-D")
    if kv.shape[1] != block_size:
        _fail(f"block_size={block_size} does not match the cache's block dimension {kv.shape[1]}")
    return kv


def _gather_pages(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    used = blocks[: -(-length // cache.shape[1])].long()
    return cache[used].reshape(-1, cache.shape[2], cache.shape[3])[:length]


#: Hardware rules of npu_fused_infer_attention_score (torch_npu 2.13.0's ``_op_plugin_docs.py``):
#: query float16/bfloat16/int8 (not int8 with page attention), key/value float16/bfloat16/int8.
IFA_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.int8)
IFA_KV_DTYPES = (torch.float16, torch.bfloat16, torch.int8)
MAX_BLOCK_SIZE = 512


def _check_ifa_rules(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kw: dict[str, Any]) -> None:
    """Refuse what the hardware refuses (dtypes, layouts, page-attention sizes), as the real op does."""
    if query.dtype not in IFA_QUERY_DTYPES:
        _fail(f"query dtype {query.dtype} is not supported; the op takes float16, bfloat16 or int8 queries")
    for name, t in (("key", key), ("value", value)):
        if t.dtype not in IFA_KV_DTYPES:
            _fail(f"{name} dtype {t.dtype} is not supported; the op takes float16, bfloat16 or int8")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not t.is_contiguous():
            _fail(f"{name} is not contiguous (non-contiguous tensors are not supported)")
    if key.shape != value.shape:
        _fail(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    heads, kv_heads = kw["num_heads"], kw["num_key_value_heads"] or kw["num_heads"]
    if kv_heads and heads // max(kv_heads, 1) > 64:
        _fail(f"num_heads / num_key_value_heads = {heads // kv_heads} exceeds 64")
    block_table = kw["block_table"]
    if block_table is None:
        return
    if query.dtype == torch.int8:
        _fail("page attention (block_table) does not support an int8 query")
    if block_table.dtype != torch.int32:
        _fail(f"block_table dtype {block_table.dtype} is not supported; it must be int32")
    block_size = kw["block_size"]
    align = 32 if key.dtype == torch.int8 else 16
    if not 0 < block_size <= MAX_BLOCK_SIZE or block_size % align:
        _fail(
            f"block_size={block_size}: page attention needs a non-zero block_size of at most "
            f"{MAX_BLOCK_SIZE}, a multiple of {align} for {key.dtype} key/value (128 recommended)"
        )
    if key.dim() == 3 and key.shape[2] > 65535:
        _fail(f"KV_N * D = {key.shape[2]} exceeds 65535 with the (blocknum, blocksize, H) cache layout")


def workspace_bytes(query: torch.Tensor, kw: dict[str, Any], kv_tokens: int) -> int:
    """The simulator's workspace rule: bytes an attention call over ``kv_tokens`` needs (fp32
    scores per query head and kv token, plus a fixed part). The hardware's formula is its own;
    what the simulator keeps is the rule that a given workspace must be at least this large."""
    return 16 * 1024 + query.shape[0] * kw["num_heads"] * max(kv_tokens, 1) * 4


def _kv_tokens(kw: dict[str, Any], lens: Any, capacity: int) -> int:
    """The kv tokens the call reads: its longest length rounded up to whole blocks (page attention)."""
    if lens is None:
        return capacity
    longest = max((int(n) for n in lens), default=0)
    block = kw["block_size"] or 1
    return -(-longest // block) * block


def _ifa_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kw: dict[str, Any]):
    _check_ifa_rules(query, key, value, kw)
    for name in _UNMODELLED_IFA:
        if kw.get(name) is not None:
            raise NotImplementedError(
                f"the torch_npu simulator does not model {name}= of npu_fused_infer_attention_score"
            )
    layout = kw["input_layout"]
    if layout not in _LAYOUTS:
        raise NotImplementedError(
            f"the torch_npu simulator models input_layout {sorted(_LAYOUTS)}, not {layout!r}"
        )
    q_layout, out_layout = _LAYOUTS[layout]
    if query.dim() != _RANK[q_layout]:
        _fail(f"Layout {q_layout}, queryDims({query.dim()}) must be {_RANK[q_layout]}")
    if kw["sparse_mode"] != 0:
        raise NotImplementedError("the torch_npu simulator models sparse_mode=0 only")
    heads = kw["num_heads"]
    q = _to_bnsd(query, q_layout, heads)
    b, n, s, _ = q.shape
    if n != heads:
        _fail(f"num_heads ({heads}) does not match the query's head count {n}")
    nkv = _kv_heads(heads, kw["num_key_value_heads"])
    lens_kv = kw["actual_seq_lengths_kv"]
    block_table = kw["block_table"]
    if block_table is not None:
        if kw["block_size"] <= 0:
            _fail("block_size must be set (non-zero) when block_table enables page attention")
        if lens_kv is None:
            _fail("actual_seq_lengths_kv is required with page attention (block_table)")
        if block_table.dim() != 2 or block_table.shape[0] != b:
            _fail(f"block_table must be [B={b}, maxBlockNumPerSeq], got {tuple(block_table.shape)}")
        kc, vc = _paged_kv(key, nkv, kw["block_size"]), _paged_kv(value, nkv, kw["block_size"])
        capacity = block_table.shape[1] * kw["block_size"]
    else:
        kc, vc = _to_bnsd(key, q_layout, nkv), _to_bnsd(value, q_layout, nkv)
        capacity = kc.shape[2]
    if lens_kv is not None and len(lens_kv) not in (1, b):
        _fail(f"actual_seq_lengths_kv has {len(lens_kv)} entries for batch {b}")
    scale = kw["scale"]
    mask = kw["atten_mask"]
    outs, lses = [], []
    for i in range(b):
        length = capacity if lens_kv is None else int(lens_kv[i if len(lens_kv) > 1 else 0])
        if not 0 <= length <= capacity:
            _fail(f"actual_seq_lengths_kv[{i}]={length} exceeds the {capacity} tokens the kv holds")
        if block_table is not None:
            k = _gather_pages(kc, block_table[i], length).transpose(0, 1)  # [Nkv, L, D]
            v = _gather_pages(vc, block_table[i], length).transpose(0, 1)
        else:
            k, v = kc[i, :, :length], vc[i, :, :length]
        k = k.repeat_interleave(n // nkv, dim=0).float()
        v = v.repeat_interleave(n // nkv, dim=0).float()
        scores = scale * (q[i].float() @ k.transpose(-1, -2))  # [N, S, L]
        if mask is not None:
            m = mask[i] if mask.dim() >= 3 else mask
            m = m.reshape(-1, m.shape[-2], m.shape[-1])[..., :s, :length]
            scores = scores.masked_fill(m.bool(), float("-inf"))
        lse = (
            torch.logsumexp(scores, dim=-1, keepdim=True) if length else torch.full((n, s, 1), float("-inf"))
        )
        probs = torch.softmax(scores, dim=-1) if length else scores.new_zeros(n, s, 0)
        outs.append(probs @ v)
        lses.append(lse)
    out = torch.stack(outs).to(query.dtype)
    if layout == "BNSD_BSND":
        out = out.transpose(1, 2)
    else:
        out = _from_bnsd(out, out_layout)
    lse = torch.stack(lses) if kw["softmax_lse_flag"] else torch.zeros(1, dtype=torch.float32)
    return out.contiguous(), lse


def _ifa_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    defaults = {
        "atten_mask": None,
        "actual_seq_lengths": None,
        "actual_seq_lengths_kv": None,
        "block_table": None,
        "num_heads": 1,
        "scale": 1.0,
        "input_layout": "BSH",
        "num_key_value_heads": 0,
        "sparse_mode": 0,
        "block_size": 0,
        "softmax_lse_flag": False,
    }
    return {**defaults, **kwargs}


def _ifa_default(query, key, value, **kwargs):
    return _ifa_reference(query, key, value, _ifa_kwargs(kwargs))


def check_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Check a call as the hardware does when a task update re-issues it, without running it.

    Returns False for an op with no such check (the caller then runs it).
    """
    if func._schema.name != f"{NAMESPACE}::npu_fused_infer_attention_score":
        return False
    query, key, value = args[:3]
    rest = {k: v for k, v in kwargs.items() if k not in ("workspace", "out")}
    _ifa_check_out(query, key, value, kwargs.get("workspace"), kwargs["out"], _ifa_kwargs(rest))
    return True


def _ifa_check_out(query, key, value, workspace, out, kw: dict[str, Any]) -> None:
    """The checks of the ``.out`` call that need no computation: rules, lengths, workspace, outputs."""
    if len(out) != 2:
        raise RuntimeError(f"out must have 2 tensors (attention_out, softmax_lse), but got {len(out)}")
    _check_ifa_rules(query, key, value, kw)
    capacity = _ifa_capacity(key, kw)
    lens = kw["actual_seq_lengths_kv"]
    if kw["block_table"] is not None and lens is None:
        _fail("actual_seq_lengths_kv is required with page attention (block_table)")
    for i, n in enumerate(lens or ()):
        if not 0 <= int(n) <= capacity:
            _fail(f"actual_seq_lengths_kv[{i}]={n} exceeds the {capacity} tokens the kv holds")
    if workspace is not None:
        need = workspace_bytes(query, kw, _kv_tokens(kw, lens, capacity))
        have = workspace.numel() * workspace.element_size()
        if have < need:
            _fail(
                f"workspace holds {have} bytes, this call needs {need}: size it with "
                "_npu_fused_infer_attention_score_get_max_workspace for the longest lengths it will see"
            )


def _ifa_out(query, key, value, *, workspace=None, out, **kwargs):
    kw = _ifa_kwargs(kwargs)
    _ifa_check_out(query, key, value, workspace, out, kw)
    attn, lse = _ifa_reference(query, key, value, kw)
    attention_out, softmax_lse = out
    if attention_out.shape != attn.shape:
        _fail(f"attention_out has shape {tuple(attention_out.shape)}, the op writes {tuple(attn.shape)}")
    attention_out.copy_(attn)
    if softmax_lse.shape == lse.shape:
        softmax_lse.copy_(lse)
    return attention_out, softmax_lse


def _ifa_capacity(key: torch.Tensor, kw: dict[str, Any]) -> int:
    """The most kv tokens a call can read: the block table's reach, or the key's sequence length."""
    if kw["block_table"] is not None:
        return kw["block_table"].shape[1] * kw["block_size"]
    return key.shape[1] if kw["input_layout"] in ("BSH", "BSND") else key.shape[2]


def _ifa_get_max_workspace(query, key, value, **kwargs):
    # Sized for the longest lengths the call's shapes allow, so any later lengths fit in it.
    kw = _ifa_kwargs(kwargs)
    _check_ifa_rules(query, key, value, kw)
    return torch.empty(
        workspace_bytes(query, kw, _ifa_capacity(key, kw)), dtype=torch.uint8, device=query.device
    )


def _ifa_infer_output(
    query,
    value,
    *,
    input_layout="BSH",
    quant_scale2=None,
    block_table=None,
    num_heads=1,
    num_key_value_heads=0,
    softmax_lse_flag=False,
    query_rope=None,
):
    if input_layout not in _LAYOUTS:
        raise NotImplementedError(f"the torch_npu simulator models input_layout {sorted(_LAYOUTS)}")
    q_layout, out_layout = _LAYOUTS[input_layout]
    b, n, s = _to_bnsd(query, q_layout, num_heads).shape[:3]
    nkv = num_key_value_heads or num_heads
    if block_table is not None:
        value_d = value.size(2) // nkv if value.dim() == 3 else value.size(3)
    else:
        value_d = value.size(2) // nkv if q_layout == "BSH" else value.size(3)
    shape = {"BSH": (b, s, n * value_d), "BSND": (b, s, n, value_d), "BNSD": (b, n, s, value_d)}[out_layout]
    dtype = torch.int8 if quant_scale2 is not None else query.dtype
    lse_shape = (b, n, s, 1) if softmax_lse_flag else (1,)
    return (
        torch.empty(shape, dtype=dtype, device=query.device),
        torch.empty(lse_shape, dtype=torch.float32, device=query.device),
    )


def _paged_attention(
    query,
    key_cache,
    value_cache,
    num_kv_heads,
    num_heads,
    scale_value,
    block_table,
    context_lens,
    out,
    *,
    workspace=None,
):
    if query.dtype not in (torch.float16, torch.bfloat16) or key_cache.dtype not in IFA_KV_DTYPES:
        raise RuntimeError(
            f"_npu_paged_attention (simulated): query {query.dtype} / key_cache {key_cache.dtype} not "
            "supported (float16/bfloat16 query; float16/bfloat16/int8 cache)"
        )
    if block_table.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise RuntimeError(
            f"_npu_paged_attention (simulated): block_table ({block_table.dtype}) and context_lens "
            f"({context_lens.dtype}) must be int32"
        )
    if query.shape[1] != num_heads or key_cache.shape[2] != num_kv_heads or num_heads % num_kv_heads:
        raise RuntimeError(
            f"_npu_paged_attention (simulated): num_heads={num_heads} / num_kv_heads={num_kv_heads} do not "
            f"match query {tuple(query.shape)} and key_cache {tuple(key_cache.shape)}"
        )
    lens = context_lens.tolist()  # read on the host at launch, exactly like the ATB kernel
    group = num_heads // num_kv_heads
    for i in range(query.shape[0]):
        k = _gather_pages(key_cache, block_table[i], lens[i]).transpose(0, 1).repeat_interleave(group, 0)
        v = _gather_pages(value_cache, block_table[i], lens[i]).transpose(0, 1).repeat_interleave(group, 0)
        scores = scale_value * (query[i].float().unsqueeze(1) @ k.float().transpose(-1, -2))  # [N, 1, L]
        out[i].copy_((torch.softmax(scores, dim=-1) @ v.float()).squeeze(1))


# -- norms and quantisation ----------------------------------------------------------------------


def _rms(x: torch.Tensor, gamma: torch.Tensor, epsilon: float, dtype: torch.dtype):
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(dtype), rstd


_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_norm(op: str, x: torch.Tensor, gamma: torch.Tensor) -> None:
    """npu_rms_norm / npu_add_rms_norm: float16/bfloat16/float32 input, gamma of the same dtype."""
    if x.dtype not in _NORM_DTYPES or gamma.dtype != x.dtype:
        raise RuntimeError(
            f"{op} (simulated): input {x.dtype} and gamma {gamma.dtype} not supported: float16, "
            "bfloat16 or float32 input, and gamma of the same dtype"
        )


def _rms_norm(input, gamma, epsilon=1e-06):
    _check_norm("npu_rms_norm", input, gamma)
    return _rms(input, gamma, epsilon, input.dtype)


def _add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    _check_norm("npu_add_rms_norm", x1, gamma)
    # The fused kernel adds in float32 and normalises that sum before rounding anything.
    summed = x1.float() + x2.float()
    y, rstd = _rms(summed, gamma, epsilon, x1.dtype)
    return y, rstd, summed.to(x1.dtype)


_QUANT_RANGE = {torch.int8: (-128, 127), torch.uint8: (0, 255), torch.int32: (-(2**31), 2**31 - 1)}

#: torch_npu passes ScalarType enum values for ``int dtype`` / ``int? dst_type`` (its meta kernels' map).
_DTYPE_CODES = {
    0: torch.uint8,
    1: torch.int8,
    3: torch.int32,
    12: torch.int8,
    13: torch.uint8,
    14: torch.int32,
}


def _dtype_of(code: int | None) -> torch.dtype:
    if code is None:
        return torch.int8
    if code not in _DTYPE_CODES:
        raise NotImplementedError(
            f"the torch_npu simulator quantises to int8/uint8/int32, not dtype code {code}"
        )
    return _DTYPE_CODES[code]


def _saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    lo, hi = _QUANT_RANGE[dtype]
    return torch.round(x).clamp(lo, hi).to(dtype)


def _broadcast_param(p: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    if p.numel() == 1:
        return p.float().reshape(())
    shape = [1] * x.dim()
    shape[axis % x.dim()] = p.numel()
    return p.float().reshape(shape)


def _quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    s = _broadcast_param(scales, input, axis)
    y = input.float() / s if div_mode else input.float() * s
    if zero_points is not None:
        y = y + _broadcast_param(zero_points, input, axis)
    return _saturate(y, _dtype_of(dtype))


def _dynamic_quant(
    input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken", dst_type_max=0.0
):
    if input.dtype not in (torch.float16, torch.bfloat16) or input.dim() < 2:
        raise RuntimeError(
            f"npu_dynamic_quant (simulated): x must be float16/bfloat16 with more than one dim, got "
            f"{input.dtype} of {input.dim()} dims"
        )
    if group_index is not None or quant_mode != "pertoken":
        raise NotImplementedError(
            "the torch_npu simulator models per-token npu_dynamic_quant without group_index"
        )
    target = _dtype_of(dst_type)
    x = input.float()
    if smooth_scales is not None:
        x = x * smooth_scales.float()
    qmax = dst_type_max or float(_QUANT_RANGE[target][1])
    scale = x.abs().amax(dim=-1) / qmax  # one scale per token: shape x.shape[:-1]
    # An all-zero row has scale 0; the simulator quantises it to 0 (hardware behaviour unverified).
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return _saturate(x / safe.unsqueeze(-1), target), scale


def _rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    if rotate is not None or rotary_mode != "half":
        raise NotImplementedError(
            "the torch_npu simulator models npu_rotary_mul in 'half' mode without rotate"
        )
    if input.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        raise RuntimeError("npu_rotary_mul (simulated): input, r1 and r2 must be 4-D")
    if any(t.dtype not in _NORM_DTYPES for t in (input, r1, r2)):
        raise RuntimeError(
            "npu_rotary_mul (simulated): input, r1 and r2 must be float16, bfloat16 or float32"
        )
    x = input.float()
    x1, x2 = torch.chunk(x, 2, -1)
    return (r1.float() * x + r2.float() * torch.cat((-x2, x1), dim=-1)).to(input.dtype)


_KERNELS = {
    "npu_fused_infer_attention_score": _ifa_default,
    "npu_fused_infer_attention_score.out": _ifa_out,
    "_npu_fused_infer_attention_score_get_max_workspace": _ifa_get_max_workspace,
    "_npu_fused_infer_attention_score_infer_output": _ifa_infer_output,
    "_npu_paged_attention": _paged_attention,
    "npu_rms_norm": _rms_norm,
    "npu_add_rms_norm": _add_rms_norm,
    "npu_quantize": _quantize,
    "npu_dynamic_quant": _dynamic_quant,
    "npu_rotary_mul": _rotary_mul,
}

assert set(_KERNELS) == set(SCHEMAS)
