"""DEVGRAPH_COMPARE_EAGER on vLLM's own engine: sampled FULL replays also run eagerly and are compared.

On the CPU reference a replay equals eager, so every sampled step must report no output difference
and no flipped token, with the logits found through the model's ``compute_logits`` (rows > 0).
"""

from __future__ import annotations

import json
import textwrap

from _engine import HERE, engine_env, run_python

DRIVER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {here!r})
    from _run_engine import main
    main({model!r}, "FULL_DECODE_ONLY", {out!r})
    from devgraph.adapters.vllm import _compare_eager
    results = [
        {{"step": r.step, "max_abs": r.max_abs, "rows": r.rows, "flips": len(r.flips)}}
        for r in _compare_eager.CHECK.results
    ]
    json.dump({{"results": results, "replays": _compare_eager.CHECK.replays}}, open({checks!r}, "w"))
    """
)


def test_sampled_full_replays_are_compared_with_eager(tiny_model, tmp_path):
    out, checks = tmp_path / "run.json", tmp_path / "checks.json"
    code = DRIVER.format(here=str(HERE), model=str(tiny_model), out=str(out), checks=str(checks))
    proc = run_python(["-c", code], engine_env(True, DEVGRAPH_COMPARE_EAGER="2"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    record = json.loads(checks.read_text())
    assert record["replays"] > 2
    assert len(record["results"]) == record["replays"] // 2  # every 2nd replay, and only those
    for result in record["results"]:
        assert result["rows"] > 0  # the model's logits were found (compute_logits)
        assert result["max_abs"] == 0 and result["flips"] == 0
    assert json.loads(out.read_text())["stats"].get("replay.FULL", 0) > 0
