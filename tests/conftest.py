from __future__ import annotations

import os

import pytest

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


@pytest.fixture
def fresh_plugins():
    """Forget loaded plugins before and after a test that changes what is installed."""
    from devgraph import _plugins

    _plugins._reset_for_tests()
    yield
    _plugins._reset_for_tests()
