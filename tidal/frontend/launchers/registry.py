"""``--data-parallel-backend`` -> its launcher (docs/architecture.md#launchers)."""

from __future__ import annotations

from tidal.config import EngineConfig
from tidal.frontend.launchers.base import Launcher
from tidal.frontend.launchers.mp import MPLauncher


def make_launcher(config: EngineConfig, entry_module: str | None = None) -> Launcher:
    """The launcher of ``config.parallel.data_parallel_backend``. ``entry_module``: what
    engine processes run (tests substitute stand-ins)."""
    if config.parallel.data_parallel_backend == "ray":
        # Ray is an optional dependency (tidal[ray]): imported only when it is chosen.
        from tidal.frontend.launchers.ray import RayLauncher

        return RayLauncher(config, entry_module)
    return MPLauncher(config, entry_module)
