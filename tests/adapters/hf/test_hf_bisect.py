"""``devgraph.bisect(graphed, input_ids, **generate_kwargs)`` of a Hugging Face ``GraphedCausalLM``: the
call ``generate`` takes, the step that served it (prefill pieces or decode step), the op (issue 48)."""

from __future__ import annotations

import pytest
from torch import nn

pytest.importorskip("transformers")

from _hf_models import prompts, tiny_model

import devgraph
from devgraph import DevgraphError
from devgraph.debug import BisectOptions


class Planted(nn.Module):
    """A decoder layer with a planted difference, off until ``how`` is set (wrap's checks run clean).

    ``"rows"``: from position 8 on, every row adds the batch's mean row: a bucket's padding rows
    change it, so a decode step from position 8 (decode step 3 of a 6-token prompt) differs from
    eager on the call, and the steps before it do not. ``"tokens"``: every token adds the mean
    token: the prefill pieces' padding tokens change it; a decode step (one token) is unchanged.
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.how: str | None = None

    def forward(self, hidden_states, *args, position_ids=None, **kwargs):
        if self.how == "rows":
            late = (position_ids >= 8).to(hidden_states.dtype)[..., None]
            hidden_states = hidden_states + late * hidden_states.mean(0, keepdim=True)  # planted: rows
        elif self.how == "tokens":
            hidden_states = hidden_states + 0.5 * hidden_states.mean(1, keepdim=True)  # planted: tokens
        return self.layer(hidden_states, *args, position_ids=position_ids, **kwargs)


def planted(mode: str, at: int = 1, **options):
    model = tiny_model("llama")
    model.model.layers[at] = layer = Planted(model.model.layers[at])
    return devgraph.wrap(model, "cpu", max_cache_len=32, mode=mode, **options), layer


def test_what_generate_takes_is_bisected_and_no_step_differs():
    graphed, _ = planted("full", batch_sizes=[2])
    ids, mask = prompts(2, seed=1, length=6)
    report = devgraph.bisect(graphed, ids, attention_mask=mask)  # was a TypeError (attention_mask)
    assert report.identical and report.ops_compared > 0
    assert "no step differs" in report.subject and "decode step 3 of generate, the last" in report.subject
    text = report.text()
    assert "each of the 3 steps served from graphs (decode step 1 of generate" in text
    assert "the prefill runs eagerly" in text


@pytest.mark.parametrize(
    ("frontend", "rows", "bucket"),
    # Dynamo specialises a batch of one row: its graph serves exactly one row, without padding
    [("raw", 1, 2), ("dynamo", 3, 4)],
)
def test_a_difference_from_a_later_decode_step_is_named_with_its_step_and_line(frontend, rows, bucket):
    graphed, layer = planted("full", batch_sizes=[bucket], frontend=frontend)
    ids, mask = prompts(rows, seed=1, length=6)  # a padding row in the bucket
    layer.how = "rows"  # Dynamo's guard on the attribute fails: the step is traced again
    # rtol: past the GEMMs' rounding by row count (one row against two) on machines that have it
    report = devgraph.bisect(
        graphed, ids, attention_mask=mask, max_new_tokens=5, bisect_options=BisectOptions(rtol=1e-3)
    )
    assert "decode step 3 of generate:" in report.subject, report.text()
    first = report.first
    assert first is not None and first.op == "aten::mean", report.text()
    assert "planted: rows" in first.source and first.module == "model.model.layers.1"
    assert first.against == "the call"
    assert (
        "the 2 step(s) before it agree (decode step 1 of generate, decode step 2 of generate)"
        in report.text()
    )


def test_the_piecewise_prefill_is_reached_and_bisected():
    graphed, layer = planted("piecewise", at=0, batch_sizes=[2])  # before layer 0 writes the cache
    ids, mask = prompts(1, seed=2, length=6)  # padded to the pieces' size 16
    layer.how = "tokens"
    report = devgraph.bisect(graphed, ids, attention_mask=mask, max_new_tokens=2)
    assert "the prefill pieces, prompt row 1 of 1:" in report.subject, report.text()
    assert "PrefillRow wrapped piecewise, the pieces of size 16 serving a call of 6 tokens" in report.subject
    first = report.first
    assert first is not None and first.op == "aten::mean", report.text()
    assert "planted: tokens" in first.source and first.module == "model.model.layers.0"
    assert "host values differ" not in first.hint
    assert "cumulative_length.add_) differs by design" in report.text()


def test_a_generate_served_eagerly_is_refused_naming_the_reason():
    graphed, _ = planted("full", batch_sizes=[2])
    ids, mask = prompts(1, seed=1, length=6)
    with pytest.raises(DevgraphError, match=r"served no step from graphs.*beam_search"):
        with pytest.warns(UserWarning):
            devgraph.bisect(graphed, ids, attention_mask=mask, num_beams=2, max_new_tokens=2)


def test_capture_options_and_a_cpu_reference_are_refused():
    graphed, _ = planted("full", batch_sizes=[2])
    ids, mask = prompts(1, seed=1, length=6)
    with pytest.raises(DevgraphError, match="capture_args"):
        devgraph.bisect(graphed, ids, bisect_options=BisectOptions(capture_args=(ids,)))
    with pytest.raises(DevgraphError, match="reference='cpu'"):
        devgraph.bisect(graphed, ids, attention_mask=mask, bisect_options=BisectOptions(reference="cpu"))
