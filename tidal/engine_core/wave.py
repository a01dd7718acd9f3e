"""One engine's half of the DP wave protocol (pure: no sockets, no clocks).

The protocol -- the three roles (frontend, engine, coordinator), their rules and the races
they are safe against -- is written down once, in the module docstring of
``tidal.dp_coordinator.state``; this class is the "Engine" paragraph there. It lives in
the engine's layer because the engine must not import the coordinator above it.
"""

from __future__ import annotations

from tidal.protocol.messages import StartDPWave


class EngineWaveState:
    """One engine's half of the wave protocol (used by DPEngineCoreProc).

    Each method returns the wave to report as ``start_wave`` (or None)."""

    def __init__(self, engine_id: int, wave: int = 0) -> None:
        self.engine_id = engine_id
        self.wave = wave
        self.running = False

    def on_request(self, request_wave: int) -> int | None:
        if self.running:
            return None
        self.running = True
        if request_wave < self.wave:
            return self.wave  # nobody else knows this wave must start
        self.wave = request_wave
        return None

    def on_start_wave(self, msg: StartDPWave) -> bool:
        """Apply START_DP_WAVE; True when it made this engine start running."""
        if msg.exclude_engine_id == self.engine_id or msg.wave < self.wave:
            return False  # started on its own / crossed a wave end (race 2)
        started = not self.running
        self.wave = msg.wave
        self.running = True
        return started

    def on_wave_end(self) -> int:
        """The all-reduce found the group idle: pause; returns the completed wave (rank 0
        reports it as ``wave_complete``)."""
        done = self.wave
        self.wave = done + 1
        self.running = False
        return done
