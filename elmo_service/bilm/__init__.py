"""The biLM and how it runs: the model's math (``model``, ``lstm``, ``config``), its inputs
(``char_ids``, ``lexicon``), the kernels that run it fast on a CPU (``kernels``) and the
per-sentence layer cache (``layer_cache``).

Everything outside this package reaches the model through its public names only.
"""
