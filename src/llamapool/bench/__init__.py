"""Benchmarks: ``llamapool bench`` and its scenarios.

- :mod:`~llamapool.bench.workloads`: named request sets (``short``, ``rag``, ``long``, ``mixed``), seeded;
- :mod:`~llamapool.bench.drivers`: one client-side measurement core with two transports, the SDK
  (a llamapool daemon) and HTTP (an OpenAI-compatible ``/v1/completions`` or llama-server's
  ``/completion``), and the result row both report;
- :mod:`~llamapool.bench.ceiling`: the engine alone (llama.cpp, no service) on the same lengths;
- :mod:`~llamapool.bench.router_only`: the router path with an echo engine against bare pyzmq;
- :mod:`~llamapool.bench.scenarios`: a long prompt among streams, prompts sharing a prefix;
- :mod:`~llamapool.bench.agent`: ``--scenario agent``, sessions whose context grows turn after turn;
- :mod:`~llamapool.bench.speculation`: ``--scenario speculation``, replies that copy their prompt, on vs off;
- :mod:`~llamapool.bench.churn`: ``--scenario pool-churn``, a busy model beside on-demand models that churn;
- :mod:`~llamapool.bench.plot`: ``--plot FILE`` (where matplotlib is installed);
- :mod:`~llamapool.bench.kvsub`: ``--kv-stall``, the workload with no, a live and a stalled KV-event subscriber;
- :mod:`~llamapool.bench.command`: the ``llamapool bench`` command.

Nothing here is imported by the daemon, and nothing here imports :mod:`llamapool.cli`.
"""
