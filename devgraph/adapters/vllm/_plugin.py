"""The ``vllm.platform_plugins`` entry point: activate the devgraph platform only when switched on."""

from __future__ import annotations

import os

__all__ = ["DEVGRAPH_VLLM_ENV", "PLATFORM_QUALNAME", "is_enabled", "register"]

#: The one switch: vLLM runs exactly as without devgraph unless it is "1".
DEVGRAPH_VLLM_ENV = "DEVGRAPH_VLLM"

#: What the plugin hands vLLM; the class is built on first access (see ``_platform``).
PLATFORM_QUALNAME = "devgraph.adapters.vllm._platform.DevgraphPlatform"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def is_enabled() -> bool:
    """True when ``DEVGRAPH_VLLM`` switches the devgraph platform on.

    A value that is neither on nor off also activates the platform, whose config check then refuses
    it with an error naming the switch: vLLM swallows exceptions raised by plugin functions, so
    raising here would silently run vLLM without devgraph.
    """
    return os.environ.get(DEVGRAPH_VLLM_ENV, "").strip().lower() not in _FALSE


def register() -> str | None:
    """vLLM platform plugin: the devgraph platform's qualified name when switched on, else None.

    Never raises and imports nothing heavy: vLLM calls it while it resolves its platform and treats
    an exception as "not this plugin". Problems (an unavailable devgraph device, a bad switch value)
    are reported by the platform at engine start instead.
    """
    return PLATFORM_QUALNAME if is_enabled() else None


def switch_value_error() -> str | None:
    """Why the switch's value is not understood (None when it is "1"-like)."""
    value = os.environ.get(DEVGRAPH_VLLM_ENV, "").strip().lower()
    if value in _TRUE or value in _FALSE:
        return None
    return f"{DEVGRAPH_VLLM_ENV}={os.environ[DEVGRAPH_VLLM_ENV]!r} is not understood; set {DEVGRAPH_VLLM_ENV}=1 or unset it"
