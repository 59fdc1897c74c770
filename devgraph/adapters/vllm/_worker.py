"""The devgraph worker: the platform's own worker, whose model runner gets devgraph's runner path.

The devgraph platform sets ``parallel_config.worker_cls`` to ``worker_qualname(base)``, where
``base`` is the worker the platform chose (vLLM's ``gpu_worker.Worker`` on CUDA, vllm-ascend's
``NPUWorker``, vLLM's ``CPUWorker``). The name carries the base, so a worker process (which
resolves the name without re-running the platform's config check) builds the same class:
``DevgraphWorkerMixin`` over the base. After the base's ``init_device`` has built its model runner,
the runner is adopted (``_runner.adopt_model_runner``). On vLLM's CPU worker, which never captures,
the mixin also makes the workspace manager that vLLM's capture loop locks and runs vLLM's own
``capture_model()`` after warm-up.
"""

from __future__ import annotations

import logging
from typing import Any

from devgraph._errors import DevgraphError

__all__ = ["DevgraphWorkerMixin", "base_of", "worker_qualname"]

logger = logging.getLogger("devgraph")

_PREFIX = "DevgraphWorker__"


def worker_qualname(base_qualname: str) -> str:
    """The qualified name vLLM resolves to the devgraph worker over ``base_qualname``."""
    if "__" in base_qualname:
        raise DevgraphError(f"cannot name a devgraph worker over {base_qualname!r} (it contains '__')")
    return f"{__name__}.{_PREFIX}{base_qualname.replace('.', '__')}"


def base_of(name: str) -> str:
    """The base worker's qualified name inside a ``worker_qualname`` class name."""
    return name[len(_PREFIX) :].replace("__", ".")


def _is_cpu_worker(worker: Any) -> bool:
    from vllm.v1.worker.cpu_worker import CPUWorker

    return isinstance(worker, CPUWorker)


class DevgraphWorkerMixin:
    """What devgraph adds to the platform's worker (see the module docstring)."""

    def init_device(self) -> None:
        from devgraph.adapters.vllm._runner import adopt_model_runner, v2_runner_message

        if getattr(self, "use_v2_model_runner", False):
            raise DevgraphError(v2_runner_message())
        super().init_device()  # type: ignore[misc]
        if _is_cpu_worker(self):
            from vllm.v1.worker.workspace import init_workspace_manager

            # capture_model() locks the workspace afterwards, so it must exist (the GPU worker makes it).
            init_workspace_manager(self.device, 1)  # type: ignore[attr-defined]
        adopt_model_runner(self.model_runner)  # type: ignore[attr-defined]

    def compile_or_warm_up_model(self) -> Any:
        from vllm.config import CUDAGraphMode
        from vllm.utils.torch_utils import set_random_seed

        times = super().compile_or_warm_up_model()  # type: ignore[misc]
        if (
            _is_cpu_worker(self)
            and not self.model_config.enforce_eager  # type: ignore[attr-defined]
            and self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE  # type: ignore[attr-defined]
        ):
            self.model_runner.capture_model()  # type: ignore[attr-defined]
            # Capture ran dummy batches; start generation from the seed as vLLM's GPU worker does.
            set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)  # type: ignore[attr-defined]
        return times

    def shutdown(self) -> None:
        # The engine's once-only eager-decode warning, if its window never closed (a short run).
        report = getattr(getattr(self, "model_runner", None), "devgraph_report_eager_decode", None)
        if report is not None:
            report()
        from devgraph.adapters.vllm._spec_decode import report_unreplayed_drafter_graphs

        report_unreplayed_drafter_graphs()
        super().shutdown()  # type: ignore[misc]


_built: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if not name.startswith(_PREFIX):
        raise AttributeError(name)
    cls = _built.get(name)
    if cls is None:
        from vllm.utils.import_utils import resolve_obj_by_qualname

        base = resolve_obj_by_qualname(base_of(name))
        cls = _built[name] = type(
            name,
            (DevgraphWorkerMixin, base),
            {
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"{base.__name__} with devgraph graphs.",
            },
        )
    return cls
