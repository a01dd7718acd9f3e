"""``--data-parallel-backend`` -> its launcher (docs/architecture.md#launchers): what each
backend can do and which flags it takes (``LauncherKind``), known without importing it (Ray
is optional), and ``make_launcher``. The engine arguments (``tidal.launch.engine_args``)
and ``launch`` (``tidal.launch.spawn``) ask a kind, never a backend's name."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidal.config import EngineConfig

if TYPE_CHECKING:
    from tidal.frontend.launchers.base import Launcher


def _no_rules(args: Any) -> None:
    pass


@dataclass(frozen=True)
class LauncherKind:
    """One ``--data-parallel-backend`` value and what it can do."""

    name: str
    # The launcher class (imported on call: an optional dependency only when chosen).
    load: Callable[[], Callable[[EngineConfig, str | None], Launcher]]
    # It places every rank itself, none beside the frontend: no ``--headless`` hosts and no
    # local share, so the control plane is TCP (``data_parallel_size_local`` resolves to 0).
    starts_all_ranks: bool = False
    # Why ``launch --headless`` is refused with it (None: other hosts join with it).
    headless_error: str | None = None
    # Its own flags: set away from their defaults, they need this backend.
    own_args: tuple[str, ...] = ()
    # Its rules over the ``EngineArgs`` (ranges are the config's): ValueError naming the field.
    check: Callable[[Any], None] = _no_rules


def _load_mp() -> type[Launcher]:
    from tidal.frontend.launchers.mp import MPLauncher

    return MPLauncher


def _load_ray() -> type[Launcher]:
    from tidal.frontend.launchers.ray import RayLauncher

    return RayLauncher


def _check_ray(args: Any) -> None:
    # Looked for, never imported: only the Ray launcher imports it.
    if importlib.util.find_spec("ray") is None:
        raise ValueError(
            "data_parallel_backend ray needs Ray, which is not installed: pip install 'tidal[ray]'"
        )
    if args.data_parallel_size_local is not None or args.data_parallel_start_rank:
        raise ValueError(
            "data_parallel_backend ray places every rank itself: drop "
            "--data-parallel-size-local / --data-parallel-start-rank (those are for "
            "--headless hosts of the mp backend)"
        )
    if args.ray_warm_ranks and not args.enable_elastic_ep:
        raise ValueError("ray_warm_ranks needs enable_elastic_ep (they serve scale-ups)")


KINDS: dict[str, LauncherKind] = {
    kind.name: kind
    for kind in (
        LauncherKind("mp", _load_mp),
        LauncherKind(
            "ray",
            _load_ray,
            starts_all_ranks=True,
            headless_error="not with --data-parallel-backend ray (Ray starts the ranks on "
            "its nodes; run `ray start --address ...` on the other hosts instead)",
            # ray_placement_timeout_s is harmless without Ray, and was never refused.
            own_args=("ray_address", "ray_warm_ranks", "ray_cpus_per_rank"),
            check=_check_ray,
        ),
    )
}


def launcher_kind(backend: str) -> LauncherKind:
    """The kind of a ``data_parallel_backend`` value (checked against the config's
    ``Literal`` already)."""
    try:
        return KINDS[backend]
    except KeyError:
        raise ValueError(
            f"data_parallel_backend must be one of {', '.join(KINDS)}; got {backend!r}"
        ) from None


def check_launcher_args(args: Any) -> LauncherKind:
    """The chosen backend's kind, with every backend's flags checked on ``args`` (the
    ``EngineArgs``): another backend's flag set is an error naming it, then the chosen
    one's own rules."""
    kind = launcher_kind(args.data_parallel_backend)
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    for other in KINDS.values():
        if other is kind:
            continue
        for name in other.own_args:
            if getattr(args, name) != defaults[name]:
                raise ValueError(f"{name} needs data_parallel_backend {other.name}")
    kind.check(args)
    return kind


def make_launcher(config: EngineConfig, entry_module: str | None = None) -> Launcher:
    """The launcher of ``config.parallel.data_parallel_backend``. ``entry_module``: what
    engine processes run (tests substitute stand-ins)."""
    return launcher_kind(config.parallel.data_parallel_backend).load()(config, entry_module)
