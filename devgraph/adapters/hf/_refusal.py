"""A ``CaptureError`` inside a Hugging Face model's own code, said so that its user can act on it.

The capture check's remedy ("create the tensor before capture", "keep the value on the device") is
advice for whoever can edit the offending line; for a transformers model that is transformers. The
user of the model can change the transformers release, generate eagerly, or (when the prefill pieces
were refused) use ``mode='full'``; ``mode=`` does not help a refused decode step, which every mode
captures whole. ``refusal`` rebuilds the error to say that, naming the model's module and line. Where the
wrap-time dry run of the decode step found it (``_decode_probe``), the one fix is eager ``model.generate()``.
"""

from __future__ import annotations

import os
from typing import Any

from devgraph._errors import CaptureError

__all__ = ["refusal"]


def _in_model_code(model: Any, source: str | None) -> str:
    """Whose code the refused line is: the model's modeling module, transformers, or the user's."""
    module = type(model).__module__
    if source is None:
        return f"somewhere in the model's forward ({module}; the line is not known)"
    path = source.split(":", 1)[0]
    if module.startswith("transformers.") and f"{os.sep}transformers{os.sep}" in path:
        return f"the model's own code in transformers ({module}), not yours"
    return "your code"


def refusal(model: Any, err: CaptureError, stage: str, at_wrap: bool = False) -> CaptureError:
    """``err`` for a user of ``model``: where the line is and what they can do.

    ``stage`` is ``"decode"`` (the decode step's graphs), ``"prefill"`` (the piecewise prefill's pieces) or
    ``"verify"`` (assisted generation's verify step, several tokens of one row).
    ``at_wrap``: found by the wrap-time dry run of the decode step (``_decode_probe``): no wrapper is
    made, and the one fix named is eager ``model.generate()``.
    """
    from transformers import __version__

    name = type(model).__name__
    where = _in_model_code(model, err.source)
    if at_wrap:
        remedy = (
            f"found at wrap, where devgraph runs one decode step eagerly under the capture check: the refused "
            f"line is {where} (transformers {__version__}). No devgraph mode serves this model: every mode "
            "replays the decode step as one graph (mode= changes only the prefill). Use eager "
            "model.generate() for it"
        )
        if where == "your code" and err.remedy:
            remedy = f"{err.remedy}; {remedy}"
        return CaptureError(
            f"{name}'s decode step cannot be captured: {err.message}",
            op=err.op,
            source=err.source,
            remedy=remedy,
        )
    if stage == "decode":
        mode_advice = (
            "mode= does not help: every mode captures the decode step whole; this wrapper now runs "
            "generate() eagerly (model.generate), counted in stats.fallbacks['capture_refused']"
        )
    elif stage == "verify":
        mode_advice = (
            "this wrapper's model now runs assisted generate() calls (prompt lookup, or drafting as an "
            "assistant_model) eagerly (model.generate), counted in stats.fallbacks['capture_refused']; the "
            "other calls still decode from graphs"
        )
    else:
        mode_advice = (
            "or wrap with mode='full' (the prefill runs eagerly, decode from graphs); this wrapper now "
            "prefills eagerly, counted in stats.fallbacks['capture_refused']"
        )
    remedy = (
        f"the refused line is {where}. What you can do: try another transformers release (this is "
        f"{__version__}; the model's code changes between releases), or generate eagerly with "
        f"model.generate(...); {mode_advice}"
    )
    if where == "your code" and err.remedy:
        remedy = f"{err.remedy}; {remedy}"
    out = CaptureError(
        f"{name}'s {stage} step cannot be captured: {err.message}",
        op=err.op,
        source=err.source,
        remedy=remedy,
        batch_size=err.batch_size,
    )
    return out
