"""``load()``: define every devgraph op and collect the backends' kernels.

It ties the two halves of ``devgraph.ops`` together: the definitions (``_defs``, which define
through the registry) and the registry (``_registry``, which knows no definition).
"""

from __future__ import annotations

import threading

from devgraph._plugins import call_each_hookimpl, plugin_manager
from devgraph.ops import _defs
from devgraph.ops._registry import register

__all__ = ["load"]

_lock = threading.RLock()
_loading = threading.local()


def load() -> None:
    """Define every devgraph op and collect backend kernels from the plugin hook.

    Idempotent, and cheap to call again (after installing a plugin, for instance): definitions are
    made once, kernels are re-collected. ``import devgraph.ops`` calls it.

    Raises:
        PluginLoadError: a plugin failed to load (the message says how to skip it).
    """
    if getattr(_loading, "active", False):
        return  # a hook implementation that imports devgraph.ops while we are loading
    with _lock:
        _loading.active = True
        try:
            _defs.define_all()
            call_each_hookimpl(
                plugin_manager().hook.devgraph_register_op_kernels,
                "registering op kernels",
                lambda origin: {"register": register},
            )
        finally:
            _loading.active = False
