"""DEVGRAPH_COMPARE_EAGER on SGLang's own engine: sampled decode replays also run eagerly, compared.

On the CPU reference, with no compiled bucket (``torch_compile_max_bs=0``) and no padding (devgraph's
decode runner replays exact sizes only), a replay is the eager step bit for bit: every sampled step
must report no difference and no flipped token, with each row's logits found (rows > 0).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt")

import tiny_model
from test_engine import _run


def test_sampled_decode_replays_are_compared_with_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("DEVGRAPH_COMPARE_EAGER", "3")
    model_dir = tiny_model.build(tmp_path / "model", "llama")
    options = ["--requests", "4", "--max-running", "4", "--max-new-tokens", "12", "--capture", "1,2,3,4"]
    out, stats, stderr = _run(model_dir, tmp_path, "graphs", *options)
    assert out, f"engine failed:\n{stderr[-6000:]}"
    replays = sum(stats["replays"].values())
    checks = stats["eager_checks"]
    assert replays >= 3 and len(checks) == replays // 3  # every 3rd replay, and only those
    for check in checks:
        assert check["rows"] > 0  # next_token_logits of SGLang's output
        assert check["max_abs"] == 0 and check["flips"] == 0
