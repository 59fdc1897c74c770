"""vLLM entry points: the platform plugin (active only when switched on) and a general plugin that keeps
the displaced platform package's general plugins working.

vLLM activates every platform plugin whose function returns a class name and refuses to start when
two do (devgraph's and vllm-ascend's ``ascend``, say). ``VLLM_PLUGINS=devgraph`` picks devgraph's,
but vLLM applies that list to every plugin group, so the platform package's *general* plugins
(vllm-ascend's model, model-loader and KV-connector registrations) would be dropped without a word.
devgraph's general plugin (``vllm.general_plugins`` entry point ``devgraph``, let through by the same
list) loads them: with ``DEVGRAPH_VLLM=1`` and ``VLLM_PLUGINS`` set, every general plugin that the list
left out and whose distribution also ships a ``vllm.platform_plugins`` entry point the list left out.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = [
    "DEVGRAPH_VLLM_ENV",
    "PLATFORM_QUALNAME",
    "displaced_general_plugins",
    "is_enabled",
    "load_general_plugins",
    "other_active_platforms",
    "register",
    "switch_setting",
    "switch_value_error",
]

logger = logging.getLogger("devgraph")

PLATFORM_GROUP = "vllm.platform_plugins"
GENERAL_GROUP = "vllm.general_plugins"

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

    Never raises and, switched off, imports nothing: vLLM calls it while it resolves its platform
    and treats an exception as "not this plugin". Problems (an unavailable devgraph device, a bad
    switch value) are reported by the platform at engine start instead. Switched on, it asks the
    other platform plugins whether they activate too (as vLLM is about to) and, if one does, logs
    the fix (``VLLM_PLUGINS=devgraph``) before vLLM stops with its bare "Only one platform plugin".
    """
    if not is_enabled():
        return None
    _warn_of_other_active_platforms()
    return PLATFORM_QUALNAME


def other_active_platforms(entry_points: Any = None) -> list[str]:
    """The platform plugins besides devgraph's that vLLM will activate (``VLLM_PLUGINS`` applied).

    Each is asked as vLLM asks it (its function returns a class name or None); one that raises is
    not active, as vLLM treats it. ``entry_points``: ``importlib.metadata.entry_points`` (tests).
    """
    import importlib.metadata

    allowed = _allowed()
    active = []
    for ep in (entry_points or importlib.metadata.entry_points)(group=PLATFORM_GROUP):
        if ep.name == "devgraph" or (allowed is not None and ep.name not in allowed):
            continue
        try:
            if ep.load()() is not None:
                active.append(ep.name)
        except Exception:  # vLLM's own rule: a failing plugin function means "not this platform"
            continue
    return active


def _warn_of_other_active_platforms() -> None:
    # vLLM refuses to start when two platform plugins activate, with an error that names neither
    # fix: say it first, from inside vLLM's plugin loop (raising here would make vLLM drop devgraph).
    others = other_active_platforms()
    if others:
        logger.error(
            "devgraph: %s switches on devgraph's vLLM platform, and the platform plugin(s) %s are "
            "active too, so vLLM will stop with 'Only one platform plugin can be activated'. Set "
            "VLLM_PLUGINS=devgraph to run on devgraph's platform (devgraph's general plugin still runs "
            "the displaced package's general plugins), or unset %s to run on %s.",
            switch_setting(),
            ", ".join(repr(name) for name in others),
            DEVGRAPH_VLLM_ENV,
            " or ".join(repr(name) for name in others),
        )


def switch_setting() -> str:
    """The switch as the user set it, quoted as given (``DEVGRAPH_VLLM='Yes '``), for messages."""
    return f"{DEVGRAPH_VLLM_ENV}={os.environ.get(DEVGRAPH_VLLM_ENV, '')!r}"


def switch_value_error() -> str | None:
    """Why the switch's value is not understood (None when it is on or off)."""
    value = os.environ.get(DEVGRAPH_VLLM_ENV, "").strip().lower()
    if value in _TRUE or value in _FALSE:
        return None
    return (
        f"{switch_setting()} is not understood (on: {', '.join(_TRUE)}; off: unset or "
        f"{', '.join(repr(v) for v in _FALSE)}); set {DEVGRAPH_VLLM_ENV}=1 to capture vLLM's graphs "
        f"through devgraph, or unset {DEVGRAPH_VLLM_ENV} to run vLLM without devgraph"
    )


def _allowed() -> list[str] | None:
    # vLLM's own parsing of VLLM_PLUGINS: comma-separated names; unset means every plugin.
    value = os.environ.get("VLLM_PLUGINS")
    return None if value is None else [name for name in value.split(",") if name]


def displaced_general_plugins(entry_points: Any = None) -> list[Any]:
    """The general-plugin entry points ``VLLM_PLUGINS`` left out that belong to a platform package
    whose platform plugin it also left out (so that devgraph's platform could be the active one).

    ``entry_points``: ``importlib.metadata.entry_points`` (a parameter for tests).
    """
    import importlib.metadata

    allowed = _allowed()
    if allowed is None or not is_enabled():
        return []
    entry_points = entry_points or importlib.metadata.entry_points

    def dist_name(ep: Any) -> str | None:
        dist = getattr(ep, "dist", None)
        return getattr(dist, "name", None)

    displaced = {
        dist_name(ep)
        for ep in entry_points(group=PLATFORM_GROUP)
        if ep.name not in allowed and ep.name != "devgraph"
    }
    displaced.discard(None)
    return [
        ep
        for ep in entry_points(group=GENERAL_GROUP)
        if ep.name not in allowed and ep.name != "devgraph" and dist_name(ep) in displaced
    ]


def load_general_plugins(entry_points: Any = None) -> list[str]:
    """vLLM general plugin: run the displaced platform package's general plugins; their names.

    A plugin that fails is logged and skipped, as vLLM itself does with general plugins.
    """
    ran = []
    for ep in displaced_general_plugins(entry_points):
        try:
            ep.load()()
        except Exception:
            logger.exception("devgraph: general plugin %s (%s) failed", ep.name, ep.value)
            continue
        ran.append(ep.name)
    if ran:
        logger.info(
            "devgraph: ran the general plugins VLLM_PLUGINS left out of the displaced platform package: %s",
            ", ".join(ran),
        )
    return ran
