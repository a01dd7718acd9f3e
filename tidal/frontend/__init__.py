"""Frontend side (layer 8, docs/architecture.md#layers): the engine clients (``core_client``: interface and
in-process; ``mp_client`` + ``sync_client`` / ``async_client``: engines in processes), the
DP routing and wave state (``dp_state``), the request book (``migrations``), liveness
verdicts (``liveness``), tokenization (``processor``), detokenization and stop strings,
request outputs and ``AsyncLLM``. Subpackages: ``launchers`` (where engine processes run,
the startup handshake, watching and stopping them) and ``scaling`` (the elastic EP
orchestration)."""
