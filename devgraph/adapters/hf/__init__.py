"""The Hugging Face transformers adapter: ``generate()`` of a causal LM with graphed decode steps.

``devgraph.wrap`` hands a transformers model here; ``wrap_hf`` is the same with the adapter's own
options (``HFOptions``). The modules: ``_adapter`` (``GraphedCausalLM``, ``wrap_hf``), ``_plan``
(which ``generate`` calls are graphed), ``_step`` (the decode step), ``_prefill`` (piecewise prefill),
``_cache`` (one static cache shared by all buckets), ``_moe`` (MoE routing replayable in a graph),
``_compat`` (the transformers releases the adapter supports), ``_checks`` (wrap-time checks: position
biases, whether the decode hook is reached), ``_static_check`` (wrap-time: logits over a static cache
against the dynamic cache's), ``_decode_probe`` (wrap-time: a decode step run eagerly under the capture
guard), ``_route`` (how generate reaches the decode step, and an assisted generate the models'
forwards), ``_verify`` (assisted generation's steps: prompt lookup, an assistant model), ``_refusal``
(a refused capture, said for the model's user).
"""

from devgraph.adapters.hf._adapter import GraphedCausalLM, HFOptions, wrap_hf
from devgraph.adapters.hf._checks import decode_hook_reachable, position_bias_source

__all__ = ["GraphedCausalLM", "HFOptions", "decode_hook_reachable", "position_bias_source", "wrap_hf"]
