"""Adapters plug devgraph into frameworks: ``hf`` (Hugging Face transformers), later vLLM and SGLang.

Adapters are leaf modules: each imports its own framework, nothing inside devgraph imports them
(``devgraph.wrap`` loads one lazily when it is handed that framework's model), and their tests skip
where the framework is not installed. Import the module you need, e.g.
``from devgraph.adapters.hf import wrap_hf``.
"""

__all__: list[str] = []
