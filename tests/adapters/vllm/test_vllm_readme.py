"""The vLLM recipe of docs/vllm.md, run as written on the tiny model with the environment the page names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from _engine import engine_env, run_python

PAGE = Path(__file__).parents[3] / "docs" / "vllm.md"


def _recipe() -> str:
    text = PAGE.read_text()
    marker = text.index("<!-- recipe.py")
    return re.search(r"```python\n(.*?)```", text[marker:], re.S).group(1)


def test_readme_vllm_recipe_runs_as_written(tiny_model, tmp_path):
    script = tmp_path / "recipe.py"
    script.write_text(_recipe())
    env = engine_env(
        devgraph=False, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", DEVGRAPH_VLLM="1"
    )
    proc = run_python([str(script), str(tiny_model)], env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stats = ast.literal_eval(proc.stdout.strip().splitlines()[-1])  # the printed stats() dict
    assert stats["replay.FULL"] > 0 and stats["update.FULL"] == stats["replay.FULL"]
