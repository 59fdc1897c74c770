"""The devgraph vLLM platform: the platform vLLM would use on devgraph's device, with devgraph graphs.

``DevgraphPlatform`` is built on first access (vLLM resolves the plugin's qualified name with
``getattr`` on this module): it subclasses vLLM's CPU platform for devgraph's ``cpu`` reference
backend, the CUDA platform for ``cuda``, vllm-ascend's NPU platform for ``npu``, and for any other
devgraph device the platform vLLM's own built-in detection picks. Only graph-related methods are
overridden; everything else is the base platform's.
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

from devgraph._errors import DevgraphError
from devgraph.adapters.vllm._plugin import DEVGRAPH_VLLM_ENV, switch_setting, switch_value_error

__all__ = ["BASE_PLATFORMS", "DevgraphPlatformMixin"]

logger = logging.getLogger("devgraph")

#: devgraph device -> the vLLM platform class that device runs under.
BASE_PLATFORMS = {
    "cpu": "vllm.platforms.cpu.CpuPlatform",
    "cuda": "vllm.platforms.cuda.CudaPlatform",
    "npu": "vllm_ascend.platform.NPUPlatform",
}

WRAPPER_QUALNAME = "devgraph.adapters.vllm._wrapper.DevgraphGraphWrapper"


class DevgraphPlatformMixin:
    """What the devgraph platform changes in the base platform (only graph capture)."""

    #: the devgraph backend graphs are captured on (None when it could not be chosen).
    devgraph_device_name: ClassVar[str | None] = None
    #: why the devgraph device cannot be used; raised at engine start (config check).
    devgraph_error: ClassVar[str | None] = None

    @classmethod
    def devgraph_device(cls) -> Any:
        """The devgraph ``Device`` graphs are captured on."""
        import devgraph

        cls.check_devgraph()
        return devgraph.device(cls.devgraph_device_name)

    @classmethod
    def check_devgraph(cls) -> None:
        """Raise the deferred setting error, if any, naming the switch and the remedy."""
        if cls.devgraph_error is None:
            return
        switch_problem = switch_value_error()
        if switch_problem is not None:
            # The value itself is the problem: quote it as given, and say nothing of devices.
            raise DevgraphError(f"devgraph's vLLM platform plugin: {switch_problem}.")
        raise DevgraphError(
            f"{switch_setting()} asks vLLM to capture its graphs through devgraph, but: "
            f"{cls.devgraph_error}. Choose an available device with DEVGRAPH_BACKEND (see "
            f"`devgraph info`), or unset {DEVGRAPH_VLLM_ENV} to run vLLM without devgraph."
        )

    @classmethod
    def apply_config_platform_defaults(cls, vllm_config: Any) -> None:
        """The base platform's defaults; notes whether the user chose how vLLM's custom ops resolve
        (vLLM picks for them right after this call, see ``_resolve_custom_ops``)."""
        super().apply_config_platform_defaults(vllm_config)  # type: ignore[misc]
        _note_custom_ops_choice(vllm_config)

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        """The base platform's check, then graphs kept on (the CPU platform turns them off)."""
        from vllm.config import CompilationMode, CUDAGraphMode

        cls.check_devgraph()
        cc = vllm_config.compilation_config
        parallel = vllm_config.parallel_config
        saved = (cc.mode, list(cc.cudagraph_capture_sizes or ()), cc.backend)
        _refuse_unsupported(vllm_config)
        super().check_and_update_config(vllm_config)  # type: ignore[misc]
        if cc.cudagraph_mode == CUDAGraphMode.NONE:
            _say_enforce_eager_turns_graphs_off(vllm_config)
            return
        _refuse_attention_limits(cls, vllm_config)
        _refuse_kv_cache_dtype(cls, vllm_config)
        breakable = _breakable_pieces(vllm_config)
        if breakable:
            # vLLM's breakable graphs (VLLM_USE_BREAKABLE_CUDAGRAPH): the PIECEWISE batches are served by
            # devgraph's breakable capture of the uncompiled model (vLLM set compilation mode NONE).
            saved = (CompilationMode.NONE, saved[1], saved[2])
            cc.mode = CompilationMode.NONE
        elif _devgraph_attention(cls, vllm_config) and cc.cudagraph_mode.requires_piecewise_compilation():
            # A FULL graph records what vLLM's opaque attention op launches, but a task update needs
            # the attention called directly (its op is then an updatable task of the graph): the
            # decode batches get FULL graphs, the rest runs eagerly.
            logger.warning(
                "devgraph vLLM platform (%s): cudagraph_mode=%s runs as FULL_DECODE_ONLY (FULL decode "
                "graphs with devgraph's task-updated attention; prefills eager)",
                cls.devgraph_device_name,
                cc.cudagraph_mode.name,
            )
            cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
        direct = _direct_devgraph_attention(cls, vllm_config)
        if direct and cc.mode == CompilationMode.VLLM_COMPILE:
            cc.mode = CompilationMode.NONE  # Dynamo cannot trace into the direct attention call
        on_cpu = _is_vllm_cpu(cls)
        if on_cpu:
            mode, sizes, backend = saved
            if direct and mode == CompilationMode.VLLM_COMPILE:
                # The attention is called directly (devgraph's op then is an updatable task of the
                # graph); Dynamo cannot trace into it, so the model runs uncompiled.
                logger.warning(
                    "devgraph vLLM platform (cpu): cudagraph_mode=%s runs the model uncompiled "
                    "(compilation mode NONE) with devgraph's attention backend",
                    cc.cudagraph_mode.name,
                )
                mode = CompilationMode.NONE
            cc.mode = mode
            # vLLM's CPU platform empties the capture sizes and swaps VLLM_COMPILE for a one-shot
            # Dynamo trace (with inductor, which needs an fp8 op vllm-cpu lacks): undo both so that
            # vLLM's piecewise backend and dispatcher run as on an accelerator.
            cc.cudagraph_capture_sizes = sizes
            # vLLM runs each size once eagerly before capturing it (one warm-up whenever graphs are
            # on), for lazy device initialisation and allocator warm-up a CUDA capture must not see.
            # The CPU reference records the ops while it runs them; the worker's start-up warm-up has
            # already run the model once: a second forward per size only costs start time.
            cc.cudagraph_num_of_warmups = 0
            if mode == CompilationMode.VLLM_COMPILE:
                cc.backend = backend if backend not in ("", "inductor") else "eager"
                _disable_cuda_only_passes(cc.pass_config)
        _resolve_custom_ops(cls, vllm_config)
        if not parallel.worker_cls.startswith(_worker_module()):
            # The platform's own worker (and model runner), with devgraph's FULL-graph runner path.
            from devgraph.adapters.vllm._worker import worker_qualname

            parallel.worker_cls = worker_qualname(parallel.worker_cls)
        _check_speculative_config(cls, vllm_config)  # on the final modes (the drafter's follow them)
        logger.info(
            "devgraph vLLM platform: device %s, cudagraph_mode %s%s, capture sizes %s",
            cls.devgraph_device_name,
            cc.cudagraph_mode.name,
            " (PIECEWISE batches from breakable graphs)" if breakable else "",
            cc.cudagraph_capture_sizes,
        )

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return True

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        return WRAPPER_QUALNAME

    @classmethod
    def get_attn_backend_cls(
        cls, selected_backend: Any, attn_selector_config: Any, num_heads: Any = None
    ) -> str:
        """devgraph's attention backend for FULL graphs on a device that freezes host arguments
        (the CPU reference, NPU), else the base platform's choice."""
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if config is not None and _devgraph_attention(cls, config):
            from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

            qualname = _attention_backend_qualname(cls, config)
            register_backend(AttentionBackendEnum.CUSTOM, qualname)
            return qualname
        return super().get_attn_backend_cls(  # type: ignore[misc]
            selected_backend, attn_selector_config=attn_selector_config, num_heads=num_heads
        )

    @classmethod
    def opaque_attention_op(cls) -> bool:
        """False for FULL graphs without pieces with devgraph's attention: the model then runs
        uncompiled and calls the attention directly (with pieces, vLLM splits at its custom op, whose
        body the graph records). True with breakable pieces: the op is where a segment ends."""
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if config is not None and _breakable_pieces(config):
            return True
        if config is not None and _direct_devgraph_attention(cls, config):
            return False
        return super().opaque_attention_op()  # type: ignore[misc]

    def graph_pool_handle(self) -> Any:
        """A new devgraph memory pool (vLLM keeps one: ``get_global_graph_pool``)."""
        return type(self).devgraph_device().pool()


def _is_vllm_cpu(cls: Any) -> bool:
    """True when the platform is vLLM's CPU platform (or a subclass of it)."""
    from vllm.platforms.interface import PlatformEnum

    return getattr(cls, "_enum", None) == PlatformEnum.CPU


def _is_cuda_alike(cls: Any) -> bool:
    """True on vLLM's CUDA and ROCm platforms (``Platform.is_cuda_alike`` is an instance method)."""
    from vllm.platforms.interface import PlatformEnum

    return getattr(cls, "_enum", None) in (PlatformEnum.CUDA, PlatformEnum.ROCM)


def _worker_module() -> str:
    return "devgraph.adapters.vllm._worker."


def _refuse_unsupported(vllm_config: Any) -> None:
    """Settings whose graphs would not be devgraph's, refused before the engine builds anything."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and getattr(model_config, "enable_sleep_mode", False):
        raise DevgraphError(
            f"{DEVGRAPH_VLLM_ENV}=1 does not support vLLM's sleep mode (enable_sleep_mode=True): sleep "
            "mode captures graphs into its own cuMem pool, which devgraph's pools do not use, so "
            f"sleeping would not free devgraph's graph memory. Turn sleep mode off or unset {DEVGRAPH_VLLM_ENV}"
        )
    cc = vllm_config.compilation_config
    if cc.cudagraph_mode is None or cc.cudagraph_mode.name == "NONE" or not _uses_v2_runner(vllm_config):
        return
    if V2_RUNNER_ENV not in os.environ:
        # vLLM picked Model Runner V2 by itself (its default for dense models on GPU): pick the V1
        # runner instead, for this process and the worker processes it starts.
        os.environ[V2_RUNNER_ENV] = "0"
        logger.warning(
            "devgraph vLLM platform: %s=0 set (Model Runner V2 captures FULL graphs without the "
            "platform's graph wrapper, so they would not be devgraph's)",
            V2_RUNNER_ENV,
        )
        if not _uses_v2_runner(vllm_config):
            return
    from devgraph.adapters.vllm._runner import v2_runner_message

    raise DevgraphError(v2_runner_message())


V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _uses_v2_runner(vllm_config: Any) -> bool:
    try:
        return bool(vllm_config.use_v2_model_runner)
    except AttributeError:
        return False


#: True once this process has said that enforce_eager=True turns devgraph's graphs off.
_said_enforce_eager = False


def _say_enforce_eager_turns_graphs_off(vllm_config: Any) -> None:
    """Warn once per process when ``enforce_eager=True`` leaves ``DEVGRAPH_VLLM=1`` without graphs.

    vLLM turns graphs off for ``enforce_eager`` (``cudagraph_mode`` NONE) before the platform's
    check, and devgraph has nothing to capture: the engine would run eagerly without a word.
    """
    global _said_enforce_eager
    model_config = getattr(vllm_config, "model_config", None)
    if _said_enforce_eager or not getattr(model_config, "enforce_eager", False):
        return
    _said_enforce_eager = True
    logger.warning(
        "devgraph vLLM platform: enforce_eager=True turns vLLM's graphs off, so %s=1 captures no "
        "devgraph graphs: every step runs eagerly, without devgraph. For devgraph's graphs drop "
        "enforce_eager=True (vLLM's default compilation config then replays FULL decode graphs through "
        "devgraph; compilation_config={'cudagraph_mode': 'PIECEWISE'} and the other modes choose others). "
        "For eager steps unset %s: it does nothing here",
        DEVGRAPH_VLLM_ENV,
        DEVGRAPH_VLLM_ENV,
    )


def _freezes_host_arguments(cls: Any) -> bool:
    """True when a FULL graph on this platform needs devgraph's attention: the devgraph device
    declares updatable ops (host arguments frozen at capture, re-issued at replay: the CPU reference,
    NPU) and the platform's own attention is not one built for device graphs (vLLM's CUDA-alike
    platforms keep theirs: FlashAttention reads its lengths from device tensors)."""
    if cls.devgraph_error is not None or cls.devgraph_device_name is None or _is_cuda_alike(cls):
        return False
    return bool(getattr(cls.devgraph_device(), "updatable_ops", ()))


def _devgraph_attention(cls: Any, vllm_config: Any) -> bool:
    """True when FULL graphs run on a device that freezes host arguments: the attention is devgraph's.

    vLLM's own attention on those devices reads host lengths that a FULL graph would freeze (and
    vLLM's CPU attention declares no FULL support, so vLLM would quietly drop FULL graphs).
    """
    if vllm_config.model_config is None:
        return False
    mode = vllm_config.compilation_config.cudagraph_mode
    return (
        mode is not None
        and mode.has_full_cudagraphs()
        and not vllm_config.model_config.use_mla
        and _freezes_host_arguments(cls)
        and not _model_attention_limits(cls, vllm_config)
    )


#: Attention features a model may use -> the argument of ``devgraph::paged_decode_attention`` doing it
#: (None: the op has none, so its kernels on every device lack the feature).
ATTENTION_FEATURES = {
    "sliding-window attention": "sliding_window",
    "attention logit soft-capping": "logits_soft_cap",
    "ALiBi position biases": None,
}


def uses_alibi(model_config: Any) -> bool:
    """True when the model adds ALiBi biases to its attention scores (Bloom, MPT, Falcon-7B's
    ``alibi``, JAIS), read from its Hugging Face config, as vLLM's model classes decide it."""
    hf = getattr(model_config, "hf_text_config", None)
    if hf is None:
        return False
    attn_config = getattr(hf, "attn_config", None)
    mpt_alibi = (
        attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", None)
    )
    return bool(
        getattr(hf, "model_type", None) == "bloom"
        or getattr(hf, "alibi", False) is True
        or mpt_alibi
        or getattr(hf, "position_embedding_type", None) == "alibi"
    )


def attention_limits(model_config: Any, unsupported_arguments: tuple[str, ...] = ()) -> list[str]:
    """The attention features the model uses that a device's ``devgraph::paged_decode_attention``
    kernel lacks: their op argument is in ``unsupported_arguments``, or the op has none (see
    ``ATTENTION_FEATURES``)."""
    hf = getattr(model_config, "hf_text_config", None)
    used = {
        "sliding-window attention": bool(getattr(model_config, "get_sliding_window", lambda: None)()),
        "attention logit soft-capping": bool(getattr(hf, "attn_logit_softcapping", None)),
        "ALiBi position biases": uses_alibi(model_config),
    }
    return [
        f
        for f, arg in ATTENTION_FEATURES.items()
        if used[f] and (arg is None or arg in unsupported_arguments)
    ]


def _uses_vllm_cpu_kernel(cls: Any) -> bool:
    """True on vLLM's CPU platform with devgraph's CPU reference: FULL decode graphs then run vLLM's
    own CPU attention kernel as the updatable task (``_cpu_attention``), which does every feature
    vLLM's CPU attention does."""
    return _is_vllm_cpu(cls) and cls.devgraph_device_name == "cpu"


def _attention_backend_qualname(cls: Any, vllm_config: Any = None) -> str:
    """The attention backend FULL graphs use on a device that freezes host arguments (on the CPU
    reference with speculative decoding, the one whose FULL graphs also serve the verify step)."""
    if _uses_vllm_cpu_kernel(cls):
        if getattr(vllm_config, "speculative_config", None) is not None:
            return "devgraph.adapters.vllm._cpu_verify_attention.DevgraphCpuSpecAttentionBackend"
        return "devgraph.adapters.vllm._cpu_attention.DevgraphCpuAttentionBackend"
    return "devgraph.adapters.vllm._attention.DevgraphAttentionBackend"


def _model_attention_limits(cls: Any, vllm_config: Any) -> list[str]:
    """What the model's attention needs that devgraph's attention on the platform's device does not do
    (nothing on the CPU reference, which runs vLLM's own kernel; on NPU sliding windows and
    soft-capping, which its kernel lacks, and ALiBi, which devgraph's op has no argument for)."""
    if vllm_config.model_config is None or cls.devgraph_error is not None or cls.devgraph_device_name is None:
        return []
    if _uses_vllm_cpu_kernel(cls):
        return []
    import devgraph.ops

    try:
        gaps = devgraph.ops.unsupported_arguments(
            "paged_decode_attention", cls.devgraph_device().dispatch_key
        )
    except DevgraphError:
        return []  # no kernel on this device: devgraph's attention is not used there
    return attention_limits(vllm_config.model_config, gaps)


def _refuse_attention_limits(cls: Any, vllm_config: Any) -> None:
    """FULL graphs on a device whose devgraph attention kernel lacks a feature the model uses: refused.

    The platform's own attention would have its host arguments frozen by a FULL graph, and devgraph's
    kernel there cannot compute the feature: refuse at engine start, never a different answer.
    """
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs() or not _freezes_host_arguments(cls):
        return
    limits = _model_attention_limits(cls, vllm_config)
    if limits:
        # Words for the user who chose nothing: vLLM's default mode captures FULL decode graphs too.
        default = " (vLLM's default)" if mode.name == "FULL_AND_PIECEWISE" else ""
        raise DevgraphError(
            f"devgraph's vLLM platform: this model uses {' and '.join(limits)}, which devgraph's attention on "
            f"devgraph device {cls.devgraph_device_name!r} does not do. cudagraph_mode={mode.name}{default} "
            "captures FULL decode graphs, and on this device FULL graphs need devgraph's attention (the "
            "platform's own reads host lengths a FULL graph would freeze). Pass "
            "compilation_config={'cudagraph_mode': 'PIECEWISE'} (graphs of the pieces between the "
            f"attention calls, the platform's attention eager) for this model, or unset {DEVGRAPH_VLLM_ENV}"
        )


def _refuse_kv_cache_dtype(cls: Any, vllm_config: Any) -> None:
    """FULL graphs with devgraph's attention and a KV-cache dtype it does not take: refused.

    On the CPU reference FULL decode graphs run vLLM's CPU kernel as devgraph's task with the cache
    unquantised (no fp8); devgraph's own attention (NPU) takes ``kv_cache_dtype='auto'`` only. Refused
    here, before the weights load, rather than when the attention layers are built.
    """
    cache_config = getattr(vllm_config, "cache_config", None)
    if cache_config is None or not _devgraph_attention(cls, vllm_config):
        return
    dtype = cache_config.cache_dtype
    if _uses_vllm_cpu_kernel(cls):
        from vllm.utils.torch_utils import is_quantized_kv_cache

        refused, keeps = is_quantized_kv_cache(dtype), "keeps the KV cache unquantised"
    else:
        refused, keeps = dtype != "auto", "keeps the KV cache in the model's dtype (kv_cache_dtype='auto')"
    if not refused:
        return
    mode = vllm_config.compilation_config.cudagraph_mode
    default = " (vLLM's default)" if mode.name == "FULL_AND_PIECEWISE" else ""
    raise DevgraphError(
        f"devgraph's vLLM platform: kv_cache_dtype={dtype!r} with cudagraph_mode={mode.name}{default}: on "
        f"devgraph device {cls.devgraph_device_name!r} FULL decode graphs run devgraph's task-updated "
        f"attention, which {keeps}. Pass kv_cache_dtype='auto', or "
        "compilation_config={'cudagraph_mode': 'PIECEWISE'} (graphs of the pieces between the attention "
        f"calls, the platform's attention and its {dtype} cache eager), or unset {DEVGRAPH_VLLM_ENV}"
    )


def _check_speculative_config(cls: Any, vllm_config: Any) -> None:
    """Speculative decoding: refused where devgraph's FULL graphs cannot serve the verify step
    (``_spec_decode.check_speculative_config``)."""
    if getattr(vllm_config, "speculative_config", None) is None:
        return
    from devgraph.adapters.vllm._spec_decode import check_speculative_config

    check_speculative_config(
        cls,
        vllm_config,
        devgraph_attention=_devgraph_attention(cls, vllm_config),
        cpu_kernel=_uses_vllm_cpu_kernel(cls),
    )


def _breakable_pieces(vllm_config: Any) -> bool:
    """True when vLLM's PIECEWISE batches come from breakable graphs: vLLM's own switch
    ``VLLM_USE_BREAKABLE_CUDAGRAPH`` is on and the mode has PIECEWISE graphs (PIECEWISE,
    FULL_AND_PIECEWISE). vLLM's opaque attention op is then the break, so it stays opaque."""
    from devgraph.adapters.vllm._breakable import breakable_enabled

    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is not None and mode.has_piecewise_cudagraphs() and breakable_enabled()


def _direct_devgraph_attention(cls: Any, vllm_config: Any) -> bool:
    """FULL graphs without pieces with devgraph's attention: the model runs uncompiled and calls the
    attention directly, so that a FULL graph captures devgraph's op as an updatable task."""
    mode = vllm_config.compilation_config.cudagraph_mode
    return _devgraph_attention(cls, vllm_config) and not mode.requires_piecewise_compilation()


#: Set on the compilation config by ``apply_config_platform_defaults``: True when the user gave no base
#: mode for vLLM's custom ops ("all" / "none"), so that vLLM picks one from the compilation config.
_CUSTOM_OPS_UNCHOSEN = "_devgraph_custom_ops_unchosen"
CUSTOM_OPS_BASES = ("all", "none")


def _note_custom_ops_choice(vllm_config: Any) -> None:
    cc = vllm_config.compilation_config
    setattr(cc, _CUSTOM_OPS_UNCHOSEN, not any(base in cc.custom_ops for base in CUSTOM_OPS_BASES))


def custom_ops_base(mode: Any, backend: str) -> str:
    """vLLM's own rule for the base mode of its custom ops (``VllmConfig.__post_init__``): their torch
    implementations ("none") for inductor to compile, their platform kernels ("all") otherwise."""
    from vllm.config import CompilationMode

    return "none" if backend == "inductor" and mode != CompilationMode.NONE else "all"


def _resolve_custom_ops(cls: Any, vllm_config: Any) -> None:
    """vLLM's custom ops (RMSNorm, SiluAndMul, rotary, ...) resolved for the compilation that runs.

    vLLM picks their base mode before the platform's check, from the compilation mode and backend it
    was given: for its default config (``VLLM_COMPILE`` with inductor) their torch implementations,
    which inductor fuses. On vLLM's CPU platform devgraph never runs inductor while it captures graphs
    (the model runs uncompiled, or Dynamo-split into eager pieces), so that choice would leave the
    model on torch code that neither vLLM engine a user runs executes there: ``enforce_eager`` runs
    vLLM's C++ kernels (``torch.ops._C.rotary_embedding``, ...), the default config inductor's code.
    vLLM's own rule applied to the compilation devgraph runs gives the kernels ``enforce_eager`` runs.
    A base mode the user chose stays; so does vLLM's choice where devgraph keeps vLLM's compilation
    (other platforms; no graphs: this runs only once graphs are kept on).
    """
    cc = vllm_config.compilation_config
    if not getattr(cc, _CUSTOM_OPS_UNCHOSEN, False) or not _is_vllm_cpu(cls):
        return
    want = custom_ops_base(cc.mode, cc.backend)
    bases = [op for op in cc.custom_ops if op in CUSTOM_OPS_BASES]
    if bases == [want]:
        return
    cc.custom_ops = [op for op in cc.custom_ops if op not in CUSTOM_OPS_BASES] + [want]
    logger.info(
        "devgraph vLLM platform (cpu): vLLM's custom ops resolve to %s (custom_ops base mode %r, as for "
        "compilation mode %s with backend %r; vLLM chose %s for the compilation it was given)",
        "their platform kernels" if want == "all" else "their torch implementations",
        want,
        cc.mode.name,
        cc.backend,
        bases,
    )


def _disable_cuda_only_passes(pass_config: Any) -> None:
    # VLLM_COMPILE turns vLLM's fusion passes on by optimisation level, but on the CPU build those
    # passes are never imported (vLLM imports them for CUDA/ROCm/XPU only): leave them off.
    turned_off = []
    for name, value in vars(pass_config).items():
        if name.startswith(("fuse_", "enable_")) and value:
            setattr(pass_config, name, False)
            turned_off.append(name)
    if turned_off:
        logger.info("devgraph vLLM platform (cpu): vLLM fusion passes off: %s", ", ".join(turned_off))


def _vllm_default_platform() -> str:
    """The platform vLLM's built-in detection picks (what vLLM runs on without plugins)."""
    from vllm.platforms import builtin_platform_plugins

    for detect in builtin_platform_plugins.values():
        try:
            qualname = detect()
        except Exception:  # vLLM itself treats a failing detector as "not this platform"
            continue
        if qualname is not None:
            return qualname
    return "vllm.platforms.interface.UnspecifiedPlatform"


def _choose_device() -> tuple[str | None, str | None]:
    """(devgraph device name, error): ``DEVGRAPH_BACKEND`` or the best available device."""
    import devgraph

    problem = switch_value_error()
    if problem is not None:
        return None, problem
    try:
        return devgraph.device().name, None
    except DevgraphError as exc:
        return None, f"the devgraph device cannot be used: {exc}"


def _build_platform() -> type:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    name, error = _choose_device()
    base_qualname = BASE_PLATFORMS.get(name or "") or _vllm_default_platform()
    try:
        base = resolve_obj_by_qualname(base_qualname)
    except ImportError as exc:
        error = (
            error
            or f"devgraph device {name!r} runs under vLLM platform {base_qualname}, which cannot be imported: {exc}"
        )
        base = resolve_obj_by_qualname(_vllm_default_platform())
    attrs = {
        "__module__": __name__,
        "__doc__": f"vLLM's {base.__name__} with graphs captured and replayed through devgraph.",
        "devgraph_device_name": name,
        "devgraph_error": error,
        "_global_graph_pool": None,
    }
    return type("DevgraphPlatform", (DevgraphPlatformMixin, base), attrs)


_platform_cls: type | None = None


def __getattr__(name: str) -> Any:
    global _platform_cls
    if name == "DevgraphPlatform":
        if _platform_cls is None:
            _platform_cls = _build_platform()
        return _platform_cls
    raise AttributeError(name)
