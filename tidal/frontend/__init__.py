"""Frontend side (layer 8, DESIGN.md 1): the engine clients (``core_client``: interface and
in-process; ``mp_client`` + ``sync_client`` / ``async_client``: engines in processes), the
engine process manager and handshake (``proc_manager``), the DP routing and wave state
(``dp_state``), tokenization (``processor``), detokenization and stop strings, request
outputs and ``AsyncLLM``."""
