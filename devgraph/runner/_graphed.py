"""``GraphedModule``: what ``devgraph.wrap`` returns, a model whose calls a ``GraphRunner`` serves.

The Hugging Face adapter's ``GraphedCausalLM`` extends it. ``devgraph.GraphedModule`` loads it on
first use (the runner layer imports torch; ``import devgraph`` does not).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from devgraph._errors import DevgraphError
from devgraph.graph import Device

if TYPE_CHECKING:
    import torch

    from devgraph.runner._config import RunnerStats
    from devgraph.runner._runner import GraphRunner

__all__ = ["GraphedModule"]


class GraphedModule:
    """A model whose calls are served by captured graphs (callable like the model).

    Outputs are views of graph memory, overwritten by the next call, unless the model was wrapped
    with ``clone_outputs=True``; without it one live thread at a time may call (a second is
    refused). Attributes the wrapper does not define are the model's own.

    ``eval()``, ``train()``, ``requires_grad_()``, ``to()`` and the other ``nn.Module`` methods
    that return the module return the wrapper, so graphs keep serving calls; a change the graphs
    cannot follow (a weight moved or cast, a training flag flipped) drops them and the next call
    captures again. Moving the model off the wrapper's device is refused: wrap it again there.

    ``copy.deepcopy``, ``copy.copy``, ``pickle`` and ``torch.save`` copy the model (deep or shallow,
    as asked) and the wrapper's options, never the graphs: the copy captures on its first call.
    """

    def __init__(self, module: Any, runner: GraphRunner) -> None:
        self.module = module  # an nn.Module or any callable: the user's model
        self.runner = runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runner(*args, **kwargs)

    def capture(self, *example_args: Any, **example_kwargs: Any) -> GraphedModule:
        """Capture every bucket now from an example call (any batch size); otherwise the first call does."""
        self.runner.capture(*example_args, **example_kwargs)
        return self

    @property
    def stats(self) -> RunnerStats:
        """Counters: replays, eager calls, fallbacks by reason, capture seconds, pool bytes."""
        return self.runner.stats

    @property
    def device(self) -> Device:
        return self.runner.device

    # -- nn.Module methods that return the module: keep the wrapper -------------------------------

    def train(self, mode: bool = True) -> Any:
        """``module.train(mode)``; graphs captured in the other mode are dropped (captured again)."""
        return self._module_method("train", mode)

    def eval(self) -> Any:
        """``module.eval()``; graphs captured in training mode are dropped (captured again)."""
        return self._module_method("eval")

    def requires_grad_(self, requires_grad: bool = True) -> Any:
        """``module.requires_grad_(...)``; calls run without autograd, so the graphs stay."""
        return self._module_method("requires_grad_", requires_grad)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """``module.to(...)``; a cast drops the graphs (captured again). Raises ``DevgraphError`` for
        another device type than the wrapper's: wrap the moved model again instead."""
        import torch

        target = torch._C._nn._parse_to(*args, **kwargs)[0]
        return self._module_method("to", *args, to_device=target, **kwargs)

    def cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self._module_method("cuda", *args, to_device="cuda", **kwargs)

    def cpu(self) -> Any:
        return self._module_method("cpu", to_device="cpu")

    def half(self) -> Any:
        return self._module_method("half")

    def float(self) -> Any:
        return self._module_method("float")

    def double(self) -> Any:
        return self._module_method("double")

    def bfloat16(self) -> Any:
        return self._module_method("bfloat16")

    def type(self, dst_type: torch.dtype | str) -> Any:
        return self._module_method("type", dst_type)

    def apply(self, fn: Callable[[torch.nn.Module], None]) -> Any:
        return self._module_method("apply", fn)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``module.load_state_dict(...)``. Loaded in place (the default) the graphs keep serving the
        new values; with ``assign=True`` the weights are new tensors at new addresses, so the graphs
        are dropped and the next call captures again."""
        return self._module_method("load_state_dict", state_dict, strict=strict, assign=assign)

    def _module_method(
        self, name: str, *args: Any, to_device: str | torch.device | None = None, **kwargs: Any
    ) -> Any:
        """Run ``module.<name>(...)``; drop the graphs when it changed what they captured; return
        the wrapper where the module returned itself."""
        if to_device is not None:
            self._check_device(name, to_device)
        from devgraph.runner._weights import captured_state

        before = captured_state(self.module)
        result = getattr(self.module, name)(*args, **kwargs)
        if captured_state(self.module) != before:
            self._drop_graphs()  # weights moved, cast or replaced, or a training flag flipped
        return self if result is self.module else result

    def _drop_graphs(self) -> None:
        """Forget everything captured for the module as it was; the next call captures again."""
        self.runner.reset()

    def _check_device(self, name: str, target: str | torch.device) -> None:
        import torch

        kind = torch.device(target).type
        mine = torch.device(self.device.torch_device).type
        if kind != mine:
            raise DevgraphError(
                f".{name}() would move the model to {kind}, but this wrapper captures on {self.device} "
                f"({mine}); its graphs cannot follow. Wrap the moved model again: "
                f"devgraph.wrap(model.{name}(...), device={kind!r})"
            )

    # -- copies: the model and the options, never the graphs -------------------------------------

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphedModule:
        self._check_copyable("copy.deepcopy")
        module = copy.deepcopy(self.module, memo)
        fn = copy.deepcopy(self.runner.fn, memo)  # the module's copy when it is the module (the memo)
        return GraphedModule(module, self.runner.fresh(fn))

    def __copy__(self) -> GraphedModule:
        self._check_copyable("copy.copy")
        return GraphedModule(self.module, self.runner.fresh(self.runner.fn))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (``pickle``, ``torch.save``) as the model, the device and the options."""
        self._check_copyable("pickling (pickle, torch.save)")
        runner = self.runner
        same = runner.fn is self.module
        return (
            _unpickle,
            (self.module, None if same else runner.fn, runner.device.torch_device, _PickledOptions(runner)),
        )

    def _check_copyable(self, what: str) -> None:
        if type(self) is not GraphedModule and type(self).__reduce__ is GraphedModule.__reduce__:
            raise DevgraphError(
                f"{what} of a {type(self).__name__} is not supported: it holds more than a model and its "
                "options (caches, engine state). Copy the model and wrap the copy: "
                "devgraph.wrap(copy.deepcopy(graphed.module), ...); save weights with "
                "torch.save(graphed.module.state_dict(), ...)"
            )

    def __getattr__(self, name: str) -> Any:
        if name in ("module", "runner"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return (
            f"<GraphedModule {type(self.module).__name__} on {self.runner.device}, sizes {self.runner.sizes}>"
        )


class _PickledOptions:
    """A runner's options as pickled: its config, how it was built, never its graphs or threads."""

    def __init__(self, runner: GraphRunner) -> None:
        self.config = runner.config
        self.built_with = runner._built_with


def _unpickle(module: Any, fn: Any, device: Any, options: _PickledOptions) -> GraphedModule:
    """A wrapper of ``module`` (calls served for ``fn``, default the module) rebuilt on ``device`` with
    the pickled options; its first call captures."""
    from devgraph._plugins import device as find_device
    from devgraph.runner._runner import GraphRunner

    compile_config, caller_serialises, is_decode, part = options.built_with
    fresh = GraphRunner(
        module if fn is None else fn,
        find_device(device),
        options.config,
        compile_config,
        caller_serialises=caller_serialises,
        is_decode=is_decode,
        part=part,
    )
    return GraphedModule(module, fresh)
