"""``--data-parallel-backend mp|ray`` and the ``--ray-*`` flags: checked where they enter
(a bad value names its flag at the CLI), Ray looked for but not imported, and a Ray
cluster that cannot be reached is a clear error in seconds (docs/architecture.md#launchers)."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from tidal.launch.args import add_engine_args, build_engine_config
from tidal.launch.engine_args import EngineArgs


def _cfg(path: str, **kw):
    return EngineArgs(model=path, **kw).create_engine_config()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"data_parallel_backend": "slurm"}, "data_parallel_backend"),
        ({"ray_address": "127.0.0.1:6379"}, "ray_address"),  # needs the ray backend
        ({"ray_warm_ranks": 1}, "ray_warm_ranks"),
        ({"ray_cpus_per_rank": 2}, "ray_cpus_per_rank"),
        ({"data_parallel_backend": "ray", "ray_placement_timeout_s": 0}, "ray_placement_timeout_s"),
        ({"data_parallel_backend": "ray", "ray_cpus_per_rank": 0}, "ray_cpus_per_rank"),
        ({"data_parallel_backend": "ray", "ray_warm_ranks": 1}, "ray_warm_ranks"),  # elastic
        (
            {"data_parallel_backend": "ray", "ray_warm_ranks": -1, "enable_elastic_ep": True},
            "ray_warm_ranks",
        ),
        ({"data_parallel_backend": "ray", "data_parallel_size_local": 1}, "data_parallel_backend"),
    ],
)
def test_bad_backend_values_name_the_field(qwen3_ckpt, kwargs, field):
    pytest.importorskip("ray")
    with pytest.raises(ValueError, match=field):
        _cfg(qwen3_ckpt, **kwargs)


def test_ray_backend_places_every_rank_and_makes_its_own_secret(qwen3_ckpt):
    pytest.importorskip("ray")
    par = _cfg(qwen3_ckpt, data_parallel_size=2, data_parallel_backend="ray").parallel
    assert par.data_parallel_backend == "ray" and par.data_parallel_size_local == 0
    assert par.data_parallel_auth_key and len(par.data_parallel_auth_key) >= 16
    assert _cfg(qwen3_ckpt).parallel.data_parallel_backend == "mp"  # the default


def test_cli_error_names_the_flag(qwen3_ckpt, capsys):
    parser = argparse.ArgumentParser(prog="launch")
    add_engine_args(parser)
    ns = parser.parse_args(["--model", qwen3_ckpt, "--data-parallel-backend", "slurm"])
    with pytest.raises(SystemExit):
        build_engine_config(parser, ns)
    assert "--data-parallel-backend: data_parallel_backend must be one of mp, ray" in (
        capsys.readouterr().err
    )


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
def test_only_the_ray_launcher_imports_ray(qwen3_ckpt):
    """Choosing the backend imports nothing of Ray; the mp path never does."""
    code = (
        "import sys\n"
        "from tidal.launch.engine_args import EngineArgs\n"
        f"EngineArgs(model={qwen3_ckpt!r}, data_parallel_backend='ray').create_engine_config()\n"
        "import tidal.frontend.async_llm, tidal.frontend.launchers.registry\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow  # starts processes: the fast tier stays under 2 minutes
@pytest.mark.timeout(120)
def test_an_unreachable_ray_cluster_is_a_clear_launch_error(qwen3_ckpt):
    """``launch`` names the address and the flag, and exits 1 (no traceback); ray.init
    alone would retry for minutes (the test's timeout would end it instead)."""
    pytest.importorskip("ray")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    args = ["--model", qwen3_ckpt, "--dp", "2", "--data-parallel-backend", "ray"]
    done = subprocess.run(
        [sys.executable, "-m", "tidal.launch.cli", "serve", "--port", "0", *args,
         "--ray-address", address],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert f"launch: error: data_parallel_backend ray: cannot use the Ray cluster at {address}" in (
        done.stderr
    )
    assert "--ray-address" in done.stderr and "Traceback" not in done.stderr
