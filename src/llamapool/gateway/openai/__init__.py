"""OpenAI's API, one module per endpoint: ``chat`` (``/v1/chat/completions``), ``completions``,
``responses``, ``embeddings``, ``rerank`` (Jina's, and Cohere's ``/v2/rerank``), ``models``;
``generation`` is what chat and completions share (their parameters, serving and event stream) and
``shapes`` their response bodies.

Parameters OpenAI defines that llamapool cannot honour are refused by name, never silently ignored;
fields nobody defines are ignored, as OpenAI-compatible servers do.
"""
