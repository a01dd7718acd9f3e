"""Frontend side (layer 8, docs/architecture.md#layers): the engine client (``async_client``:
engines in processes, on an event loop, composed of ``transport``, ``router``,
``migrator`` and ``liveness_monitor``; ``loop_client``: the same client behind a blocking
facade for ``LLM``; ``core_client``: that interface, and in-process), the DP routing and
wave state (``dp_state``), the request book (``request_book``), liveness verdicts
(``liveness``), tokenization (``processor``), detokenization and stop strings,
request outputs and ``AsyncLLM``. Subpackages: ``launchers`` (where engine processes run,
the startup handshake, watching and stopping them) and ``scaling`` (the elastic EP
orchestration)."""
