"""Adapters plug devgraph into engines and frameworks: ``hf`` (Hugging Face transformers), ``vllm``
and ``sglang``.

Adapters are leaf packages: each imports its own framework, nothing inside devgraph imports them
(``devgraph.wrap`` loads one lazily when it is handed that framework's model), and their tests skip
where the framework is not installed. Import the package you need, e.g.
``from devgraph.adapters.hf import wrap_hf``.
"""

__all__: list[str] = []
