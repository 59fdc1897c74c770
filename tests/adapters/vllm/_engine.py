"""Helpers of the vLLM adapter tests: engine processes and their environment."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ENGINE_TIMEOUT_S = 900


def engine_env(devgraph: bool, backend: str = "cpu", **extra: str) -> dict[str, str]:
    """The environment of one engine process: in-process engine core, 1 GiB KV cache, the switch.

    ``backend="toy"`` is the third-party test backend (tests/plugins/devgraph_toy_backend).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEVGRAPH_", "VLLM_"))}
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="WARNING",
        TOKENIZERS_PARALLELISM="false",
    )
    if devgraph:
        env["DEVGRAPH_VLLM"] = "1"
        env["DEVGRAPH_BACKEND"] = backend
        # Every replay checks that vLLM passed the capture-time buffers (the wrapper's debug check).
        env["DEVGRAPH_DEBUG"] = "1"
        if backend == "toy":
            env["DEVGRAPH_TOY_BACKEND"] = "1"
    env.update(extra)
    return env


def run_python(code_or_script: list[str], env: dict[str, str], timeout: int = ENGINE_TIMEOUT_S):
    """Run ``python ARGS`` in a fresh process; return the CompletedProcess (text output)."""
    return subprocess.run(
        [sys.executable, *code_or_script], env=env, capture_output=True, text=True, timeout=timeout
    )


#: Every engine run the tests read, (model, mode, devgraph backend or None), started together (each
#: engine uses one torch thread). "default" is vLLM's default compilation config, unchanged.
ALL_RUNS = (
    ("llama", "eager", None),
    ("llama", "default", "cpu"),
    ("llama", "PIECEWISE", "cpu"),
    ("llama", "FULL", "cpu"),
    ("llama", "FULL_DECODE_ONLY", "cpu"),
    ("llama", "FULL_AND_PIECEWISE", "cpu"),
    ("llama", "PIECEWISE", "toy"),
    ("qwen2", "eager", None),
    ("qwen2", "default", "cpu"),
    ("qwen2moe", "eager", None),
    ("qwen2moe", "default", "cpu"),
    ("mixtral", "default", "cpu"),
    ("sliding", "eager", None),
    ("sliding", "default", "cpu"),
    ("gemma2", "eager", None),
    ("gemma2", "default", "cpu"),
    ("gemma2", "FULL", "cpu"),
    ("bloom", "eager", None),
    ("bloom", "default", "cpu"),
    # vLLM's VLLM_USE_BREAKABLE_CUDAGRAPH=1: PIECEWISE batches from devgraph's breakable graphs.
    ("llama", "breakable:PIECEWISE", "cpu"),
    ("qwen2", "breakable:PIECEWISE", "cpu"),
    ("llama", "breakable:FULL_AND_PIECEWISE", "cpu"),
    ("mixtral", "eager", None),
    ("mixtral", "breakable:FULL_AND_PIECEWISE", "cpu"),
    # enforce_eager with the switch on: graph-less, said once.
    ("llama", "eager", "cpu"),
    # An fp8 KV cache: PIECEWISE graphs with vLLM's attention eager (FULL graphs are refused).
    ("llama", "kv-fp8:PIECEWISE", "cpu"),
    ("llama", "kv-fp8:eager", None),
    # As users run it: no DEVGRAPH_DEBUG, only the first replay of each graph checks its inputs.
    ("llama", "no-debug:default", "cpu"),
)


class EngineRuns:
    """Engine runs by (model, mode, devgraph backend or None), each in its own process, cached for the
    session.

    All runs start on first use, ``DEVGRAPH_VLLM_TEST_JOBS`` (default: half the CPUs, at least 1) at a
    time, so that CI with more cores waits for the slowest engine rather than their sum.
    ``DEVGRAPH_VLLM_TEST_LAZY=1`` starts only the runs the selected tests ask for (one test at a
    time on a small machine).
    """

    def __init__(self, models: dict[str, Path], workdir: Path) -> None:
        self.models = models
        self.workdir = workdir
        jobs = int(os.environ.get("DEVGRAPH_VLLM_TEST_JOBS", max(1, (os.cpu_count() or 2) // 2)))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
        self.runs: dict[tuple[str, str, str | None], concurrent.futures.Future] = {}

    def _run(self, key: tuple[str, str, str | None]) -> subprocess.CompletedProcess:
        model, mode, devgraph = key
        out = self.workdir / f"{model}-{mode}-{devgraph}.json"
        env = engine_env(devgraph is not None, backend=devgraph or "cpu")
        proc = run_python([str(HERE / "_run_engine.py"), str(self.models[model]), mode, str(out)], env)
        return proc, out

    def __call__(self, mode: str, devgraph: str | None, model: str = "llama") -> dict:
        if not self.runs and os.environ.get("DEVGRAPH_VLLM_TEST_LAZY") != "1":
            self.runs = {key: self.pool.submit(self._run, key) for key in ALL_RUNS}
        key = (model, mode, devgraph)
        if key not in self.runs:
            self.runs[key] = self.pool.submit(self._run, key)
        proc, out = self.runs[key].result()
        if proc.returncode != 0:
            pytest.fail(f"engine run {key} failed:\n{proc.stderr[-6000:]}")
        record = json.loads(out.read_text())
        record["log"] = proc.stderr
        return record
