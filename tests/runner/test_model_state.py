"""What the forward changes in the model while devgraph captures it: put back exactly, or refused by name.

Warm-ups, capture and the padding check run the forward several times (issue 32). Tensors written
in place come back to their values before capture (the graphs replay the write, so they advance once
per real call); Python state a graph would freeze is refused by its path; state the padding rows
change makes padded calls run eagerly; random-number generators are put back, so the first served
call after ``torch.manual_seed`` draws what eager's first call draws.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import devgraph
from devgraph import DevgraphError
from devgraph.runner import _snapshot


def _x(n: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _raw(model, **options):
    """``devgraph.wrap(model, frontend="raw", ...)``: the test's subject is the raw path's own
    mechanism (its one warning of what it leaves unchecked is expected, not counted)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*captures the forward as it runs, untraced")
        return devgraph.wrap(model, frontend="raw", **options)


def _served_like_eager(model: torch.nn.Module, sizes: list[int], calls: list[int], **options):
    """Wrap ``model``, call it and an eager twin alike; return both and the wrapper."""
    twin = copy.deepcopy(model)
    graphed = _quiet(devgraph.wrap, model, device="cpu", batch_sizes=sizes, **options)
    for i, n in enumerate(calls):
        got = _quiet(graphed, _x(n, seed=i))
        torch.testing.assert_close(got, twin(_x(n, seed=i)), msg=f"call {i} ({n} rows)")
    return graphed, model, twin


# -- tensors written in place: restored, then advanced once per real call ---------------------------


class TensorCounter(torch.nn.Module):
    """A counter in a plain tensor attribute, not a registered buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.count = torch.zeros(())

    def forward(self, x):
        self.count += 1
        return x + self.count


def test_a_plain_tensor_attribute_counter_counts_real_calls_only():
    graphed, model, twin = _served_like_eager(TensorCounter(), [2, 4], [4, 4, 2])
    assert model.count.item() == twin.count.item() == 3  # warm-ups, capture and checks left no trace
    assert graphed.stats.replays == 3


class BiasEma(torch.nn.Module):
    """A parameter written in place by the forward (an exponential moving average of its bias)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        out = self.lin(x)
        with torch.no_grad():
            self.lin.bias.mul_(0.9).add_(0.1 * out.mean(0))
        return out


@pytest.mark.parametrize(
    "frontend",
    ["raw", "dynamo"],
)
def test_a_parameter_written_in_place_advances_as_in_eager(frontend):
    _, model, twin = _served_like_eager(BiasEma(), [4], [4, 4, 4], frontend=frontend)
    torch.testing.assert_close(model.lin.bias, twin.lin.bias)


class DataCounter(torch.nn.Module):
    """A buffer written through ``.data``: no version bump (as an extension kernel writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n.data.add_(1)
        return x * 2


def test_a_buffer_written_without_a_version_bump_is_restored():
    _, model, _ = _served_like_eager(DataCounter(), [2, 4], [4, 2, 4])
    assert model.n.item() == 3


class HeldGenerator(torch.nn.Module):
    """Noise from a generator the model holds."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(7)

    def forward(self, x):
        return x + torch.rand(x.shape, generator=self.gen)


def test_a_generator_the_model_holds_is_put_back():
    model = HeldGenerator()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    twin = torch.Generator().manual_seed(7)
    for _ in range(2):  # the first served call draws what eager's first call draws, then the next
        torch.testing.assert_close(graphed(_x()), _x() + torch.rand(4, 4, generator=twin))


# -- Python state a graph freezes: refused by its path, put back ----------------------------------


class Appends(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.history: list[int] = []

    def forward(self, x):
        self.history.append(x.shape[0])
        return x * 2


class _Config:
    def __init__(self) -> None:
        self.step = 0


class ConfigStep(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = _Config()

    def forward(self, x):
        self.cfg.step += 1
        return x * 2


class KeepsHidden(torch.nn.Module):
    def forward(self, x):
        self.last_hidden = x * 2
        return self.last_hidden + 1


class CountsInDict(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = {"forward": 0}

    def forward(self, x):
        self.calls["forward"] += 1
        return x * 2


@pytest.mark.parametrize(
    ("model", "named"),
    [
        (Appends(), r"list history changed \(\[\] -> \[4, 4"),
        (ConfigStep(), r"attribute cfg\.step \(0 -> \d+\)"),
        (KeepsHidden(), r"attribute last_hidden \(<unset> -> <tensor \[4, 4\]"),
        (CountsInDict(), r"dict calls changed at 'forward' \(0 -> \d+\)"),
    ],
    ids=["list", "object_field", "stored_tensor", "dict"],
)
def test_python_state_the_forward_changes_is_refused_by_path_and_put_back(model, named):
    before = copy.deepcopy(vars(model))
    graphed = _raw(model, device="cpu", batch_sizes=[4])  # the raw path's StateSnapshot
    with pytest.raises(DevgraphError, match=named):
        graphed(_x())
    after = vars(model)
    assert after.keys() == before.keys()
    assert repr(getattr(model, "history", None)) == repr(before.get("history"))
    assert getattr(getattr(model, "cfg", None), "step", 0) == 0
    assert getattr(model, "calls", {"forward": 0}) == {"forward": 0}


@pytest.mark.parametrize("cls", [Appends, ConfigStep, KeepsHidden, CountsInDict])
def test_python_state_the_forward_changes_advances_as_in_eager_through_dynamo(cls):
    # Dynamo replays the forward's Python side effects at every call: served, not refused.
    model, twin = cls(), cls()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    for i in range(3):
        torch.testing.assert_close(_quiet(graphed, _x(seed=i)), twin(_x(seed=i)))
    assert repr(getattr(model, "history", None)) == repr(getattr(twin, "history", None))
    assert getattr(getattr(model, "cfg", None), "step", 0) == getattr(getattr(twin, "cfg", None), "step", 0)
    assert getattr(model, "calls", None) == getattr(twin, "calls", None)


class BigEma(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(16))

    def forward(self, x):
        with torch.no_grad():
            self.w.add_(1)
        return x * 2


def test_a_parameter_too_large_to_copy_written_in_place_is_refused(monkeypatch):
    monkeypatch.setattr(_snapshot, "_CLONE_LIMIT", 8)  # as a parameter of 2**20+ elements
    graphed = _raw(BigEma(), device="cpu", batch_sizes=[4])  # the raw path's StateSnapshot
    with pytest.raises(
        DevgraphError, match=r"parameter 'w' written in place \(too large.*cannot be put back"
    ):
        graphed(_x())


# -- state the padding rows change: padded calls run eagerly --------------------------------------


class RowCount(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.n += x.shape[0]
        return x * 2


def test_a_count_of_rows_does_not_count_padding_rows():
    graphed, model, twin = _served_like_eager(RowCount(), [4], [3, 4, 3])
    assert model.n.item() == twin.n.item() == 10
    assert graphed.stats.fallbacks == {"padding_changes_result": 2} and graphed.stats.replays == 1


class RunningMin(torch.nn.Module):
    """An observer keeping the running minimum of its inputs (a quantization range); its output does
    not read it, so only the state shows what the padding rows did."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("low", torch.full((4,), float("inf")))

    def forward(self, x):
        self.low.copy_(torch.minimum(self.low, x.min(0).values))
        return x * 2


def test_a_running_minimum_never_takes_the_pad_value():
    # Inputs above 1: a pad row of zeros would make the minimum 0.
    model = RunningMin()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    x = torch.rand(3, 4) + 1
    torch.testing.assert_close(_quiet(graphed, x), x * 2)
    torch.testing.assert_close(model.low, x.min(0).values)
    assert graphed.stats.fallbacks == {"padding_changes_result": 1}


class ScratchSlot(torch.nn.Module):
    """A cache written at each row's slot; padded rows point at slot 0, which no real row reads
    (``reads_scratch=False``) or which every row reads, before this call's writes (True): what
    padding rows wrote there shows in the next call only."""

    def __init__(self, reads_scratch: bool) -> None:
        super().__init__()
        self.reads_scratch = reads_scratch
        self.register_buffer("cache", torch.ones(16, 4))

    def forward(self, x, slot):
        seen = self.cache[0] * 1 if self.reads_scratch else 0
        self.cache.index_copy_(0, slot, x)
        return self.cache.index_select(0, slot) * 2 + seen


def test_padding_rows_may_write_a_scratch_slot_no_real_row_reads():
    model = ScratchSlot(reads_scratch=False)
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    x, slot = _x(3), torch.tensor([3, 5, 7])
    torch.testing.assert_close(graphed(x, slot), x * 2)
    assert graphed.stats.replays == 1 and not graphed.stats.fallbacks
    torch.testing.assert_close(model.cache[[3, 5, 7]], x)


def test_padding_rows_must_not_write_where_real_rows_read():
    model = ScratchSlot(reads_scratch=True)
    twin = copy.deepcopy(model)
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    for i in range(2):
        x, slot = _x(3, seed=i), torch.tensor([3, 5, 7])
        torch.testing.assert_close(_quiet(graphed, x, slot), twin(x, slot))
    assert graphed.stats.fallbacks == {"padding_changes_result": 2}
    torch.testing.assert_close(model.cache, twin.cache)


# -- randomness: the first served call after a seed draws what eager's first call draws -----------


class Dropout(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5, training=True)


class Samples(torch.nn.Module):
    def forward(self, x):
        return torch.multinomial(x.softmax(-1), 1)


class NoisyAttention(torch.nn.Module):
    def forward(self, x):
        q = x.reshape(x.shape[0], 1, 2, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)


@pytest.mark.parametrize(
    "model", [Dropout(), Samples(), NoisyAttention()], ids=["dropout", "sampling", "sdpa"]
)
def test_the_first_call_after_a_seed_draws_what_eager_draws(model, any_device):
    graphed = devgraph.wrap(model, device=any_device, batch_sizes=[4])
    x = _x().to(any_device.torch_device)
    for seed in (0, 1):
        torch.manual_seed(seed)
        got = [_quiet(graphed, x).clone() for _ in range(2)]
        torch.manual_seed(seed)
        want = [model(x) for _ in range(2)]
        torch.testing.assert_close(got, want, msg=f"seed {seed}")
    assert graphed.stats.replays == 4
