"""A one-minute smoke test of a devgraph backend: the conformance suite, then one paged-attention capture.

The first thing the GPU one-shot measures after the install (``tools/gpu_oneshot.sh``), so that even
a run cut short says whether devgraph captures and replays on the device at all. Order:

1. every conformance check (``devgraph.testing.conformance``) but the one that makes captures fail;
2. one capture of ``devgraph::paged_decode_attention`` (the flex kernel on CUDA, block size 16) with
   its task update, replayed with new lengths and compared with the float64 reference kernel;
3. ``check_capture_error_on_host_sync`` (four captures CUDA invalidates), then a capture after it and
   ``empty_cache()``: on torch 2.11 the allocator's state after a failed capture is what breaks
   (pytorch #180395, cleaned up by the CUDA backend), so it runs last, where it can spoil nothing.

The JSON report is rewritten after every item (``"complete": false`` until the end)::

    python tools/gpu_smoke.py --device cuda --out smoke.json
    python tools/gpu_smoke.py --device cpu --out smoke.json      # the reference backend (seconds)

Exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    import devgraph
except ImportError:  # a source checkout that was never pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import devgraph

import devgraph.ops as ops
from devgraph.backends import _reference
from devgraph.testing import conformance

#: Runs last: it makes captures fail on purpose (see the module docstring).
FAILING_CAPTURES = "check_capture_error_on_host_sync"


def _write(report: dict[str, Any], path: Path, complete: bool = False) -> None:
    from _provenance import checkout  # tools/ is this script's folder: the commit and the tree's state

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps({**report, "checkout": checkout(), "complete": complete}, indent=2) + "\n")
    os.replace(tmp, path)


def _timed(fn: Callable[[], Any]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        detail = fn()
    except conformance.NotApplicable as why:
        return {"status": "not applicable", "reason": str(why), "seconds": time.perf_counter() - start}
    except Exception as exc:
        return {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
            "seconds": time.perf_counter() - start,
        }
    return {"status": "passed", "seconds": time.perf_counter() - start, **(detail or {})}


def paged_attention_capture(dev: devgraph.Device) -> dict[str, Any]:
    """Capture the paged decode attention op once, replay it with two new sets of lengths, compare."""
    cuda = dev.name == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    batch, hq, hkv, dim, block, max_blocks = 4, 8, 2, 64, 16, 8
    g = torch.Generator().manual_seed(0)
    num_blocks = batch * max_blocks + 1
    q = torch.randn(batch, hq, dim, generator=g).to(dev.torch_device, dtype)
    k = torch.randn(num_blocks, block, hkv, dim, generator=g).to(dev.torch_device, dtype)
    v = torch.randn(num_blocks, block, hkv, dim, generator=g).to(dev.torch_device, dtype)
    table = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)
    table = table.to(dev.torch_device, torch.int32)
    lens = [5, 40, 0, block * max_blocks]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev.torch_device)
    out = torch.empty_like(q)

    def step() -> None:
        ops.paged_decode_attention(q, k, v, table, seq_lens, lens, scale=dim**-0.5, out=out)

    start = time.perf_counter()
    stream = dev.capture_stream()
    stream.wait_stream(dev.current_stream())
    with stream:
        step()  # compiles the flex kernel (CUDA) before the capture
        step()
    dev.current_stream().wait_stream(stream)
    dev.synchronize()
    warmup_s = time.perf_counter() - start
    graph = dev.graph()
    start = time.perf_counter()
    with graph.capture(auto_update_ops=dev.updatable_ops):
        step()
    capture_s = time.perf_counter() - start
    errors = []
    for new in ([1, 2, 3, 4], [block * max_blocks, 0, 17, 33]):
        seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay(host_args={"seq_lens_host": new})
        dev.synchronize()
        want = torch.empty(q.shape, dtype=torch.float64)
        _reference.paged_decode_attention_device_lens(
            q.cpu(), k.cpu(), v.cpu(), table.cpu(), torch.tensor(new, dtype=torch.int32), dim**-0.5, want
        )
        errors.append(float((out.cpu().double() - want).abs().max()))
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    if max(errors) > tolerance:
        raise AssertionError(f"replayed paged attention differs from the reference by {max(errors):.3g}")
    return {"dtype": str(dtype), "warmup_s": warmup_s, "capture_s": capture_s, "max_abs_err": errors}


def after_failed_captures(dev: devgraph.Device) -> dict[str, Any]:
    """A capture and the allocator's own clean-up still work after captures that failed."""
    x = torch.ones(8, device=dev.torch_device)
    graph = dev.graph()
    with graph.capture():
        y = x * 3
    graph.replay()
    dev.synchronize()
    torch.testing.assert_close(y, x * 3)
    if dev.name == "cuda":
        torch.cuda.empty_cache()  # torch 2.11 asserts here if a failed capture was not cleaned up
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="devgraph backend (cuda; cpu for a dry run)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cpu":
        torch.set_num_threads(1)
    dev = devgraph.device(args.device)
    report: dict[str, Any] = {
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev.index) if dev.name == "cuda" else "cpu",
        "torch": torch.__version__,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "items": {},
    }
    checks = [c for c in conformance.CHECKS if c.__name__ != FAILING_CAPTURES]
    last = [c for c in conformance.CHECKS if c.__name__ == FAILING_CAPTURES]
    plan: list[tuple[str, Callable[[], Any]]] = [(c.__name__, lambda c=c: c(dev)) for c in checks]
    plan.append(("paged_attention_capture", lambda: paged_attention_capture(dev)))
    plan += [(c.__name__, lambda c=c: c(dev)) for c in last]
    plan.append(("capture_after_failed_captures", lambda: after_failed_captures(dev)))
    for name, fn in plan:
        report["items"][name] = result = _timed(fn)
        print(
            f"{name:<45} {result['status']:<15} {result['seconds']:7.2f} s  {result.get('error', '')[:200]}"
        )
        _write(report, args.out)
    failed = [n for n, r in report["items"].items() if r["status"] == "failed"]
    report["failed"] = failed
    _write(report, args.out, complete=True)
    print(f"{len(plan) - len(failed)} of {len(plan)} passed or not applicable; wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
