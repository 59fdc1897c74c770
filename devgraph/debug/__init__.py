"""Explaining differences between graphed and eager runs.

* ``bisect``: the first op whose replayed output differs from eager (``_bisect``), with the op
  probe that copies every op's output inside a capture (``_probe``), the plans of what to run for
  each kind of target (``_subjects``), and the comparison (``_compare``) and report (``_report``).
* a call of several graphed steps (a Hugging Face ``generate``): the wrapper records the steps it
  served (``ServesSteps``, ``StepsServed``, ``ServedStep``); the first that differs is bisected (``_steps``).
* ``compare_tokens``: token-identical, or the margin at the first differing token (``_tokens``).
* ``EagerCheck``: the engines' sampled graphed-vs-eager check (``_eager_check``;
  ``DEVGRAPH_COMPARE_EAGER``).

This package sits above ``devgraph.graph``, ``devgraph.runner`` and ``devgraph.compile`` (it uses
their faces only) and below the engine adapters. It imports torch.
"""

from __future__ import annotations

from devgraph.debug._bisect import BisectOptions, bisect
from devgraph.debug._eager_check import EagerCheck, StepComparison, eager_check_from_env
from devgraph.debug._report import BisectReport, OpDifference
from devgraph.debug._steps import ServedStep, ServesSteps, StepsServed
from devgraph.debug._tokens import TokenComparison, compare_tokens, top2_margin

__all__ = [
    "BisectOptions",
    "BisectReport",
    "EagerCheck",
    "OpDifference",
    "ServedStep",
    "ServesSteps",
    "StepsServed",
    "StepComparison",
    "TokenComparison",
    "bisect",
    "compare_tokens",
    "eager_check_from_env",
    "top2_margin",
]
