"""How transformers' ``generate`` reaches devgraph's decode step: its per-instance compiled-call switch.

transformers' ``_sample`` loop calls ``model.get_compiled_call(generation_config.compile_config)`` for
every step after the prefill when the cache is a compilable (static) one; that method returns the
instance's ``_compiled_call`` when it was made for an equal ``compile_config``. ``decode_route`` sets
those per-instance attributes (and, where a model type's ``get_compiled_call`` ignores them, shadows
that method on the instance) for one ``generate``; ``route_config`` is the ``CompileConfig`` passed.

Assisted generation (prompt lookup, an assistant model) does not use that switch: its loop
(``_assisted_decoding``) calls the model itself, ``self(**model_inputs)``, for every verify step.
``forward_route`` reaches those calls through the one per-instance attribute ``nn.Module.__call__``
reads: ``forward``. For one ``generate`` the instance's ``forward`` is devgraph's route; while the
route runs (serving the call from graphs or running the model eagerly) the attribute is taken away
again, so the model's own forward, and everything the graphs traced, is what it always is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["decode_route", "forward_route", "route_config"]


def route_config() -> Any:
    """A ``CompileConfig`` that lets ``generate`` use the per-instance compiled call on any device."""
    from transformers import CompileConfig

    # A backend name no torch.compile knows: were transformers ever to compile instead of taking the
    # per-instance call, it would fail loudly rather than run something else.
    config = CompileConfig(backend="devgraph-hf-decode-route", mode=None, fullgraph=False)  # type: ignore[arg-type]
    # transformers' switch (a class attribute it reads per instance) for auto-compile off CUDA.
    config._compile_all_devices = True  # type: ignore[assignment]
    return config


_MISSING = object()


@contextlib.contextmanager
def decode_route(model: Any, route: Any, compile_config: Any, shadow: bool = False) -> Iterator[None]:
    """Make ``model.get_compiled_call(compile_config)`` return ``route`` for one ``generate``.

    ``shadow``: for a model type whose ``get_compiled_call`` never reads the per-instance attributes
    (``decode_hook_reachable`` is False), also shadow that method on the instance (put back after).
    """
    names = ("_compiled_call", "_last_compile_config", "get_compiled_call")
    saved = {name: model.__dict__.get(name, _MISSING) for name in names}
    model.__dict__["_compiled_call"] = route
    model.__dict__["_last_compile_config"] = compile_config
    if shadow:
        model.__dict__["get_compiled_call"] = lambda compile_config=None: route
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                model.__dict__.pop(name, None)
            else:
                model.__dict__[name] = value


class _ForwardShadow:
    """The per-instance ``forward`` that sends ``model(**kwargs)`` to ``route`` (see ``forward_route``)."""

    def __init__(self, model: Any, route: Any, saved: Any) -> None:
        self.model = model
        self.route = route
        self.saved = saved  # the instance's own ``forward`` attribute (an accelerate hook's), or _MISSING

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        attrs = self.model.__dict__
        _put_back(attrs, "forward", self.saved)
        try:
            if args:  # transformers' loops pass keywords only: a positional call is someone else's
                return self.model(*args, **kwargs)
            return self.route(**kwargs)
        finally:
            attrs["forward"] = self


def _put_back(attrs: dict[str, Any], name: str, value: Any) -> None:
    if value is _MISSING:
        attrs.pop(name, None)
    else:
        attrs[name] = value


@contextlib.contextmanager
def forward_route(model: Any, route: Any) -> Iterator[None]:
    """Send every ``model(**kwargs)`` call to ``route(**kwargs)`` for one ``generate``; put back after.

    ``route`` runs with the model's own ``forward`` in place (it may call ``model(...)``, eagerly or
    inside the traced step, and reach the model itself).
    """
    saved = model.__dict__.get("forward", _MISSING)
    model.__dict__["forward"] = _ForwardShadow(model, route, saved)
    try:
        yield
    finally:
        _put_back(model.__dict__, "forward", saved)
