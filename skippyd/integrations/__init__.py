"""The engines' side of skippyd: each module plugs the client into one engine, and only it imports
that engine (never the daemon).

* :mod:`.transformers`: ``capture``/``restore`` of a Hugging Face ``DynamicCache`` (``skt``).
* :mod:`.vllm`: ``SkippydTier``, a secondary tier behind vLLM's ``OffloadingConnector``.
* :mod:`.sglang`: ``SkippydStorage``, an SGLang HiCache storage backend (loaded by module path).
* :mod:`._common`: what the engine integrations share (layout identity, option checks, admission).
"""
