"""SGLang entry points: the platform plugin's ``activate()`` and the general plugin ``register()``.

Both are cheap and inert unless devgraph is selected: installing devgraph changes no plain SGLang
run. ``activate`` answers only to ``SGLANG_PLATFORM=devgraph``; ``register`` adds an attention
backend *name* (``devgraph``) that nothing uses unless asked for and, only under
``SGLANG_PLATFORM=devgraph``, one hook through SGLang's plugin hook registry (``HookRegistry``, the
general plugins' documented way in) around ``resolve_prefill_backend``: SGLang 0.5.23 has no platform
hook for prefill graphs, and builds its CUDA breakable backend for them whatever the platform. The
hook builds devgraph's on devgraph's platform and passes every other call through
(``_prefill.resolve_prefill_backend_hook``).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

#: The value of ``SGLANG_PLATFORM`` that selects devgraph (the entry point's name).
PLATFORM_NAME = "devgraph"

#: The devgraph SGLang platform per torch device type the chosen devgraph device's tensors live on.
_PLATFORMS = {
    "cpu": "devgraph.adapters.sglang._platform:DevgraphCpuPlatform",
    "npu": "devgraph.adapters.sglang._platform:DevgraphNpuPlatform",
}


def activate() -> str | None:
    """The devgraph platform class path when ``SGLANG_PLATFORM=devgraph``, else None.

    The devgraph backend is ``devgraph.device()``'s choice (``DEVGRAPH_BACKEND`` to force one); the
    platform is the one of the torch device its tensors live on (SGLang's ``device``), so devgraph's
    NPU backend on devgraph's torch_npu simulator (tests/sim) (CPU tensors) gets the ``cpu`` platform,
    whose graphs are then NPU graphs (``_backend.devgraph_device_for``).

    Raises:
        DevgraphError: devgraph was selected but its device has no SGLang platform here, or
            ``DEVGRAPH_BACKEND`` names a backend that is unknown or unavailable (the message names
            the variable and its value).
    """
    if os.environ.get("SGLANG_PLATFORM") != PLATFORM_NAME:
        return None
    import devgraph
    from devgraph._errors import DevgraphError

    try:
        chosen = devgraph.device()
    except DevgraphError as exc:
        forced = os.environ.get("DEVGRAPH_BACKEND")
        if forced is None:
            raise
        # devgraph's message names the backend; the user set a variable: name it, as given.
        raise DevgraphError(
            f"SGLANG_PLATFORM=devgraph with DEVGRAPH_BACKEND={forced!r}: {exc}. Set DEVGRAPH_BACKEND to an "
            "available devgraph backend (`devgraph info` lists them), or unset it to let devgraph choose."
        ) from exc
    kind = chosen.torch_device.type
    if kind not in _PLATFORMS:
        raise DevgraphError(
            f"SGLANG_PLATFORM=devgraph: devgraph picked backend {chosen.name!r} (torch device {kind!r}), "
            f"which has no SGLang platform in devgraph (supported devices: {sorted(_PLATFORMS)}); set "
            "DEVGRAPH_BACKEND to a backend on one of them, or unset SGLANG_PLATFORM to use SGLang's own "
            "platform."
        )
    logger.info("devgraph SGLang platform: backend %s on torch device %s", chosen.name, kind)
    return _PLATFORMS[kind]


def register() -> None:
    """General plugin: register the ``devgraph`` attention backend with SGLang (a new name only)."""
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if ATTENTION_BACKENDS.get(PLATFORM_NAME) is not _create_attention_backend:
        register_attention_backend(PLATFORM_NAME)(_create_attention_backend)
    if os.environ.get("SGLANG_PLATFORM") == PLATFORM_NAME:
        register_prefill_hook()


def register_prefill_hook() -> bool:
    """Hook devgraph's prefill backend into SGLang's ``resolve_prefill_backend`` (once per process).

    Through SGLang's ``HookRegistry`` (an ``AROUND`` hook). Inside SGLang's ``load_plugins`` (this is
    its general plugin), SGLang applies the hooks once every plugin has registered its own; called
    from anywhere else (the platform, after the plugins loaded), it applies them at once. Returns True
    when this call registered it.
    """
    global _prefill_hooked
    if _prefill_hooked:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType, _current_plugin_source

    from devgraph.adapters.sglang._prefill import RESOLVE_PREFILL_BACKEND, resolve_prefill_backend_hook

    HookRegistry.register(RESOLVE_PREFILL_BACKEND, resolve_prefill_backend_hook, HookType.AROUND)
    if _current_plugin_source.get() is None:  # not inside load_plugins, which applies them after
        HookRegistry.apply_hooks()
    _prefill_hooked = True
    logger.info("devgraph: prefill graphs resolve through devgraph (hook on %s)", RESOLVE_PREFILL_BACKEND)
    return True


_prefill_hooked = False


def _create_attention_backend(model_runner):
    from devgraph.adapters.sglang._attention import DevgraphAttentionBackend

    return DevgraphAttentionBackend(model_runner)
