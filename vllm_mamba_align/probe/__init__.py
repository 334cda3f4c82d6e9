"""``vllm-mamba-align probe``: a black-box check of a running vLLM server.

It answers, from outside, the two questions an operator asks first: does this
server serve wrong Mamba states from its prefix cache, and how much does it
reuse? It talks HTTP only (the standard library), to any OpenAI-compatible vLLM
server, with or without this plugin installed there, and it is never imported
on the serving path.

Parts: ``workload`` (the prompts), ``client`` (HTTP), ``server_metrics``
(``/metrics``), ``judge`` (verdicts against the noise floor), ``run`` (the
requests in order), ``report`` (table, JSON, exit status), ``progress``.
"""
