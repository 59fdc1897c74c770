"""Graph families under one runner roof (issue 47): decode, verify and draft over one pool and budget.

A whole greedy speculative loop (``devgraph.testing.speculative.speculative_decode``) served by
``GraphFamilies`` equals the same loop run eagerly, token for token and acceptance for acceptance, on
the CPU reference and on devgraph's torch_npu simulator; every family captures into one pool; the
budget, a verify call at a wrong token count, a family never replayed and an acceptance that differs
from eager's are refused or counted and warned by name.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import devgraph
from devgraph import DevgraphError
from devgraph.runner import VERIFY_TOKEN_COUNT, GraphFamilies, RunnerConfig
from devgraph.testing.models import DecoderConfig, KVBlockManager, PagedDecoder, make_decoder
from devgraph.testing.speculative import eager_families, perturbed_draft, speculative_decode

K = 3
PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]]
ROUNDS = 5


@pytest.fixture(params=["cpu", "npu-sim"])
def dev(request):
    if request.param == "cpu":
        yield devgraph.device("cpu")
        return
    from devgraph_sim.npu import simulated_torch_npu

    with simulated_torch_npu(streams="eager", hang_timeout=0.5):
        yield devgraph.device("npu")


def _config(dev) -> DecoderConfig:
    """bfloat16 on npu (its fused attention refuses float32)."""
    dtype = torch.bfloat16 if dev.name == "npu" else torch.float32
    return DecoderConfig(num_layers=1, dtype=dtype)


def _models(dev) -> tuple[PagedDecoder, PagedDecoder]:
    """A target and a draft: the target's weights plus noise (some drafted tokens accepted, some not)."""
    target = make_decoder(_config(dev), seed=3, device=dev.torch_device).eval()
    return target, perturbed_draft(target, noise=0.1, seed=7)


def _runner_config(**extra) -> RunnerConfig:
    opts = PagedDecoder.devgraph_options()
    extra.setdefault("batch_sizes", (1, 2))
    return RunnerConfig(pad_values=opts["pad_values"], host_args=opts["host_args"], **extra)


def _families(dev, target, draft, budget: int | None = 8) -> GraphFamilies:
    families = GraphFamilies(dev, capture_budget=budget)
    families.add("decode", target, _runner_config())
    families.add_verify("verify", target, _runner_config(), k=K, requests=(1, 2))
    families.add_draft("draft", draft, _runner_config(), k=K)
    families.add("draft_decode", draft, _runner_config())
    return families


def test_a_speculative_loop_served_by_families_equals_the_eager_loop(dev):
    target, draft = _models(dev)
    families = _families(dev, target, draft)
    check = eager_families(*_models(dev), K)  # eager on the same inputs, in step (own KV caches)
    config = _config(dev)
    served = speculative_decode(
        families.families,
        KVBlockManager(config, device=dev.torch_device),
        PROMPTS,
        K,
        ROUNDS,
        check=check,
        note=families.note_acceptance,
        sync=dev.synchronize,
    )
    eager = speculative_decode(
        eager_families(*_models(dev), K),
        KVBlockManager(config, device=dev.torch_device),
        PROMPTS,
        K,
        ROUNDS,
        sync=dev.synchronize,
    )
    assert served.tokens == eager.tokens
    assert served.accepted == eager.accepted == served.eager_accepted
    # a loop worth checking: some drafted tokens accepted, some rejected, some rounds fully accepted
    flat = [a for round_ in served.accepted for a in round_]
    assert 0 < sum(flat) < K * len(flat) and K in flat
    stats = families.report()
    acceptance = stats["acceptance"]
    assert (acceptance.accepted, acceptance.proposed) == (sum(flat), K * len(flat))
    assert acceptance.rate == sum(flat) / (K * len(flat))
    assert acceptance.eager_checks == ROUNDS and acceptance.eager_mismatches == 0
    for name in ("decode", "verify", "draft", "draft_decode"):
        s = stats[name]
        assert s.graphs == 2 and s.replays > 0 and s.eager_calls == 0 and not s.never_replayed, s
        assert s.capture_seconds > 0
    assert stats["verify"].replays == ROUNDS and stats["draft"].replays == ROUNDS
    assert families["verify"].stats.captured_sizes == (K + 1, 2 * (K + 1))  # tokens: requests x (k + 1)


def test_every_family_captures_into_one_pool_and_reports_its_growth(dev):
    target, draft = _models(dev)
    families = _families(dev, target, draft)
    speculative_decode(
        families.families,
        KVBlockManager(_config(dev), device=dev.torch_device),
        PROMPTS,
        K,
        1,
        sync=dev.synchronize,
    )
    pools = set()
    for name in ("decode", "verify", "draft_decode"):
        runner = families[name].runner
        assert runner.shared is families.shared
        pools.update(id(runner.full.graph(size).pool()) for size in runner.sizes)
    draft_part = families["draft"].runner.part
    pools.update(id(graph.graph.pool()) for graph, _ in draft_part.graphs.values())
    assert pools == {id(families.shared.current)}
    stats = families.stats()
    grown = [stats[n].pool_bytes for n in ("decode", "verify", "draft", "draft_decode")]
    assert all(isinstance(b, int) and b >= 0 for b in grown)
    assert families.pool_bytes == sum(grown) > 0


def test_families_over_the_capture_budget_are_refused_naming_each_count():
    dev = devgraph.device("cpu")
    target, draft = _models(dev)
    families = GraphFamilies(dev, capture_budget=5)
    families.add("decode", target, _runner_config())
    families.add_verify("verify", target, _runner_config(), k=K, requests=(1, 2))
    with pytest.raises(DevgraphError, match=r"6 graphs \(decode: 2, verify: 2, draft: 2\).*capture_budget=6"):
        families.add_draft("draft", draft, _runner_config(), k=K)
    assert list(families.families) == ["decode", "verify"]  # the refused family was not added


def _verify_call(dev, tokens: int) -> dict:
    manager = KVBlockManager(_config(dev), device=dev.torch_device)
    return manager.decode_batch(list(range(tokens)), [1] * tokens)


def test_a_verify_call_at_a_wrong_token_count_is_never_replayed():
    dev = devgraph.device("cpu")
    target, draft = _models(dev)
    families = _families(dev, target, draft)
    verify = families["verify"]
    batch = _verify_call(dev, 5)  # 5 tokens: not requests x (K + 1) = requests x 4
    eager_target, _ = _models(dev)
    with torch.no_grad():
        with pytest.warns(UserWarning, match=VERIFY_TOKEN_COUNT):
            out = verify(**batch)
        torch.testing.assert_close(out, eager_target(**batch), rtol=0, atol=0)
    assert verify.stats.fallbacks == {VERIFY_TOKEN_COUNT: 1} and verify.stats.replays == 0
    assert not verify.runner.captured  # nothing captured, nothing replayed at 8 tokens
    strict = GraphFamilies(dev)
    strict.add_verify("verify", target, _runner_config(strict=True), k=K, requests=(1, 2))
    with torch.no_grad(), pytest.raises(DevgraphError, match=VERIFY_TOKEN_COUNT):
        strict["verify"](**batch)


def _tiny_family(dev) -> GraphFamilies:
    families = GraphFamilies(dev)
    model = torch.nn.Linear(4, 4).eval()
    families.add("decode", model, RunnerConfig(batch_sizes=(2,)))
    with torch.no_grad():
        families["decode"].runner.capture(torch.randn(2, 4))
    return families


def test_a_family_captured_but_never_replayed_is_warned_once_and_counted():
    families = _tiny_family(devgraph.device("cpu"))
    with pytest.warns(UserWarning, match="'decode' captured 1 graph.*never replayed"):
        stats = families.report()
    assert stats["decode"].never_replayed and stats["decode"].replays == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        families.close()  # warned once already; nothing more at close or collection
        del families
        gc.collect()


def test_a_family_never_replayed_is_warned_when_the_families_are_collected():
    families = _tiny_family(devgraph.device("cpu"))
    with pytest.warns(UserWarning, match="never replayed"):
        del families
        gc.collect()


def test_a_replayed_family_is_not_warned():
    families = _tiny_family(devgraph.device("cpu"))
    with torch.no_grad():
        families["decode"](torch.randn(2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = families.close()
    assert not stats["decode"].never_replayed and stats["decode"].replays == 1


def test_an_acceptance_that_differs_from_eager_is_warned_and_counted():
    families = GraphFamilies(devgraph.device("cpu"))
    families.note_acceptance(2, 6, eager_accepted=2)
    with pytest.warns(UserWarning, match=r"acceptance from graphs \(1 of 6\) differs from eager's.*\(3\)"):
        families.note_acceptance(1, 6, eager_accepted=3)
    acceptance = families.stats()["acceptance"]
    assert (acceptance.accepted, acceptance.proposed, acceptance.rounds) == (3, 12, 2)
    assert acceptance.eager_checks == 2 and acceptance.eager_mismatches == 1 and acceptance.rate == 0.25


def _draft_args(manager: KVBlockManager, reqs: list[int], first: torch.Tensor) -> dict:
    steps = [manager.decode_batch(reqs, [0] * len(reqs)) for _ in range(K)]
    args = {
        n: torch.stack([s[n] for s in steps], dim=1)
        for n in ("positions", "block_table", "seq_lens", "slot_mapping")
    }
    return {"input_ids": first, **args, "seq_lens_host": steps[0]["seq_lens_host"]}


def test_a_draft_call_padded_to_a_bucket_equals_k_eager_steps(dev):
    _, draft = _models(dev)
    _, eager_draft_model = _models(dev)
    families = GraphFamilies(dev)
    family = families.add_draft("draft", draft, _runner_config(batch_sizes=(2,)), k=K)
    eager = eager_families(eager_draft_model, eager_draft_model, K)["draft"]
    manager = KVBlockManager(_config(dev), device=dev.torch_device)
    prompt = manager.decode_batch([0], [5])  # one request of one token, in both models' caches
    with torch.no_grad():
        draft(**prompt)
        eager_draft_model(**prompt)
        first = torch.tensor([9], device=dev.torch_device)
        for _ in range(2):  # one request, padded to the bucket of 2; lengths grow between rounds
            args = _draft_args(manager, [0], first)
            got = family(**args).clone()
            dev.synchronize()
            want = eager(**args)
            assert torch.equal(got.cpu(), want.cpu()) and got.shape == (1, K)
            first = want[:, -1].contiguous()
    assert family.stats.replays == 2 and family.stats.eager_calls == 0
