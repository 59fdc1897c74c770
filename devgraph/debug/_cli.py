"""``devgraph bisect``: the bisect from the command line, on the demo decoder or a factory of yours."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

from devgraph._errors import DevgraphError

__all__ = ["add_parser"]

_MODEL_HELP = (
    "'demo' (the tiny paged decoder of `devgraph demo`, wrapped, one decode step) or MODULE:FACTORY, a "
    "function taking no arguments that returns (target, args) or (target, args, kwargs): target is "
    "what devgraph.bisect takes (a wrapped model, a callable, or a Graph then its capture function)"
)


def add_parser(sub: Any) -> None:
    """Add ``bisect`` to the ``devgraph`` command's subparsers."""
    p = sub.add_parser("bisect", help="name the first op whose graph replay differs from eager")
    p.add_argument("model", help=_MODEL_HELP)
    p.add_argument("--device", default=None, help="backend for 'demo' (default: best available)")
    p.add_argument("--batch", type=int, default=1, help="'demo': rows in the decode step (default 1)")
    p.add_argument(
        "--bucket",
        type=int,
        default=None,
        help="'demo': the captured batch size serving it (default: --batch + 1)",
    )
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance over the noise floor")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance over the noise floor")
    p.add_argument("--save", metavar="DIR", default=None, help="write both tensors and the report to DIR")
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.set_defaults(func=run)


def _demo(device: str | None, batch: int, bucket: int | None) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    import devgraph
    from devgraph.testing.models import KVBlockManager, make_decoder

    if batch < 1:
        raise DevgraphError(f"--batch must be a positive integer, got {batch}")
    bucket = batch + 1 if bucket is None else bucket
    if bucket < batch:
        raise DevgraphError(
            f"--bucket {bucket} is smaller than --batch {batch}: the bucket serving a call holds it"
        )
    dev = devgraph.device(device)
    model = make_decoder(device=dev.torch_device)
    graphed = devgraph.wrap(model, device=dev, batch_sizes=[bucket])
    manager = KVBlockManager(model.config, device=dev.torch_device)
    tokens = [(7 * i + 3) % model.config.vocab_size for i in range(batch)]
    for _ in range(3):  # a few steps of history, so attention reads more than one token
        kwargs = manager.decode_batch(list(range(batch)), tokens)
        tokens = graphed(**kwargs).argmax(-1).tolist()
    return graphed, (), manager.decode_batch(list(range(batch)), tokens)


def _factory(spec: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise DevgraphError(f"model {spec!r}: give 'demo' or MODULE:FACTORY (e.g. mypkg.debug:make_case)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DevgraphError(f"model {spec!r}: cannot import {module_name!r} ({exc})") from None
    factory: Callable[[], Any] | None = getattr(module, attr, None)
    if not callable(factory):
        raise DevgraphError(f"model {spec!r}: {module_name} has no callable {attr!r}")
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise DevgraphError(
            f"model {spec!r}: {attr}() must return (target, args) or (target, args, kwargs), got "
            f"{type(made).__name__}"
        )
    target, args, kwargs = made if len(made) == 3 else (*made, {})
    return target, tuple(args), dict(kwargs)


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 no op differs, 1 an op differs, 2 the bisect could not run (the error says why)."""
    from devgraph.debug import BisectOptions, bisect

    try:
        if args.model == "demo":
            target, call_args, call_kwargs = _demo(args.device, args.batch, args.bucket)
        else:
            target, call_args, call_kwargs = _factory(args.model)
        options = BisectOptions(atol=args.atol, rtol=args.rtol)
        report = bisect(target, *call_args, bisect_options=options, **call_kwargs)
    except DevgraphError as exc:  # CaptureError included: the message names the op and the remedy
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        first = report.first
        print(
            json.dumps(
                {
                    "subject": report.subject,
                    "identical": report.identical,
                    "op": first.op if first else None,
                    "location": first.location if first else None,
                    "module": first.module if first else None,
                    "max_abs": first.max_abs if first else None,
                    "max_rel": first.max_rel if first else None,
                    "against": first.against if first else None,
                    "differing": report.differing,
                    "ops_compared": report.ops_compared,
                },
                indent=2,
            )
        )
    else:
        print(report.text())
    if args.save:
        for path in report.save(args.save):
            print(f"saved {path}", file=sys.stderr)
    return 0 if report.identical else 1
