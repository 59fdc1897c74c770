"""Built-in backends: cpu (reference simulator), cuda, npu.

Each registers through the ``devgraph`` entry-point group exactly like a third-party plugin.

``devgraph.backends`` is this package, whatever was imported first. Calling it, the listing
function's old name, still works for one release: it warns (``DeprecationWarning``) and returns
``devgraph.list_backends()``. The package had to win the name: importing any backend submodule
makes Python bind ``devgraph.backends`` to it.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self) -> Any:
        warnings.warn(
            "devgraph.backends() is deprecated and will be removed in the next release; call "
            "devgraph.list_backends() (devgraph.backends is the package of built-in backends)",
            DeprecationWarning,
            stacklevel=2,
        )
        from devgraph._plugins import list_backends

        return list_backends()


sys.modules[__name__].__class__ = _CallablePackage
