"""DEVGRAPH_COMPARE_EAGER on vLLM's own engine.

On vLLM's CPU platform devgraph's FULL decode graphs run vLLM's own attention kernel as a task, and an
eager re-run inside the step does not reproduce it: the check refuses to compare those steps, once,
with a warning naming what to do instead (rather than report differences that are not there).
"""

from __future__ import annotations

import json
import textwrap

from _engine import HERE, engine_env, run_python
from _run_engine import CAPTURE_SIZES

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


def test_every_sampled_full_step_equals_its_eager_rerun_on_the_real_rows(tiny_model, tmp_path):
    out, checks = tmp_path / "run.json", tmp_path / "checks.json"
    code = DRIVER.format(here=str(HERE), model=str(tiny_model), out=str(out), checks=str(checks))
    proc = run_python(["-c", code], engine_env(True, DEVGRAPH_COMPARE_EAGER="1"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    record = json.loads(checks.read_text())
    results = record["results"]
    assert len(results) == record["replays"] > 2  # every replayed step was compared
    assert [r["max_abs"] for r in results] == [0.0] * len(results)
    assert [r["flips"] for r in results] == [0] * len(results)
    # Some steps were padded (requests finished): their real rows, not the captured size, were compared.
    assert any(r["rows"] not in CAPTURE_SIZES for r in results), results
    assert json.loads(out.read_text())["stats"].get("replay.FULL", 0) > 0
