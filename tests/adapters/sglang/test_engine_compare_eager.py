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


def test_sglang_compiled_steps_are_explained_inside_the_compiled_forward(tmp_path, monkeypatch):
    """``DEVGRAPH_SGLANG_COMPILE=1``: SGLang compiles the decode forward of each captured size with
    inductor (as SGLang means ``enable_torch_compile``), devgraph captures it. The sampled check runs
    the step eagerly (the compiled forward as its original code) and finds the difference; the bisect
    of that step descends into SGLang's compiled forward and names an op of the model's code there.
    One size is compiled (about 40 s here) to keep the test short."""
    monkeypatch.setenv("DEVGRAPH_COMPARE_EAGER", "4")
    monkeypatch.setenv("DEVGRAPH_COMPARE_EAGER_BISECT", "difference")
    model_dir = tiny_model.build(tmp_path / "model", "qwen3")
    options = [
        "--requests",
        "2",
        "--max-running",
        "2",
        "--max-new-tokens",
        "10",
        "--capture",
        "2",
        "--compile",
    ]
    out, stats, stderr = _run(model_dir, tmp_path, "graphs", *options)
    assert out, f"engine failed:\n{stderr[-6000:]}"
    assert "DEVGRAPH_SGLANG_COMPILE=1: SGLang compiles the forward of decode sizes [2]" in stderr
    checks = stats["eager_checks"]
    assert checks, stats
    differing = [c for c in checks if c["max_abs"] > 0]
    assert differing, checks  # a compiled bf16 step is not the eager step (eager runs uncompiled)
    bisected = [c for c in differing if "bisect" in c]
    assert bisected, differing
    for c in bisected:
        assert c["bisect"] != "no op differs", c
        assert "torch.compile'd graph" in c["bisect_inside"] and "inductor" in c["bisect_inside"], c
        assert "qwen3.py" in c["bisect"] or "sglang" in c["bisect"], c  # an op of SGLang's model code
