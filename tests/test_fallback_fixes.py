"""Every reason devgraph runs a call eagerly under has a fix the user can apply, and its warning names it.

The reasons are collected from the code (``test_docs.fallback_reasons``, which also checks the
troubleshooting page), so a new reason without a fix in ``devgraph._fallback_fixes.FIXES`` fails here.
"""

from __future__ import annotations

import threading
import warnings

import pytest
from test_docs import fallback_reasons

from devgraph import DevgraphError
from devgraph._fallback_fixes import FIXES, with_fix
from devgraph.runner import RunnerConfig
from devgraph.runner._accounts import Accounts
from devgraph.runner._config import RunnerStats


def _reasons() -> list[str]:
    """The reasons in the code, plus the generation modes the Hugging Face adapter runs eagerly (it
    counts ``GenerationMode.value``, which the code reader cannot see)."""
    reasons = set(fallback_reasons())
    try:
        from transformers.generation.configuration_utils import GenerationMode as modes
    except ImportError:
        return sorted(reasons)
    return sorted(reasons | {m.value for m in modes} - {modes.GREEDY_SEARCH.value, modes.SAMPLE.value})


REASONS = _reasons()


def test_the_reasons_are_read_from_the_code():
    # If this fails, the collector lost track of where reasons are made (not that a fix is missing).
    assert {
        "batch_too_large",
        "use_cache",
        "beam_search",
        "decode_hook_not_reached",
        "over_capture_size",
    } <= set(REASONS)


def test_every_fallback_reason_in_the_code_has_a_fix():
    assert not [r for r in REASONS if not FIXES.get(r, "").strip()]


def test_every_fix_is_for_a_reason_the_code_counts_or_a_generation_mode():
    known = set(REASONS) | {"FULL", "PIECEWISE"}  # vLLM counts its graph modes' names
    assert not sorted(set(FIXES) - known)


def _accounts(strict: bool = False) -> Accounts:
    return Accounts(RunnerConfig(strict=strict), RunnerStats(), threading.RLock(), "from a graph")


@pytest.mark.parametrize("reason", REASONS)
def test_the_fallback_warning_names_the_fix(reason):
    accounts = _accounts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accounts.note_fallback(reason, "what happened")
    (warning,) = caught
    assert FIXES[reason] in str(warning.message)
    assert accounts.stats.fallbacks == {reason: 1}


@pytest.mark.parametrize("reason", ["batch_too_large", "use_cache", "beam_search"])
def test_the_strict_error_names_the_fix(reason):
    with pytest.raises(DevgraphError, match="Fix: "):
        _accounts(strict=True).note_fallback(reason, "what happened")


def test_a_detail_that_already_names_the_fix_is_not_repeated():
    detail = f"it happened; {FIXES['sequence_too_long']}"
    assert with_fix("sequence_too_long", detail) == detail


def test_a_reason_devgraph_does_not_know_keeps_its_detail():
    assert with_fix("a_plugins_own_reason", "detail") == "detail"


def test_a_wrapped_models_batch_too_large_warning_names_max_batch_size():
    import torch

    import devgraph

    graphed = devgraph.wrap(torch.nn.Linear(4, 4).eval(), device="cpu", max_batch_size=2)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"Fix: wrap with a larger max_batch_size"):
        graphed(torch.randn(3, 4))
    assert graphed.stats.fallbacks == {"batch_too_large": 1}
