"""Options declared once (tidal/config.py's ``option``, docs/contributing.md#options): every
flag of every command has help, and every option with choices or a range refuses a value
outside them -- from the command line as an error naming its flag, from ``LLM(**kwargs)``
and the config dataclasses as a ValueError naming the option. The cases are generated
from the declarations, so a new option is covered without touching this file."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import typing
from pathlib import Path

import pytest

from tidal.config import (
    OptionSpec,
    ParallelConfig,
    choices_of,
    engine_options,
    option_specs,
    range_of,
)
from tidal.frontend.launchers.base import Launcher
from tidal.frontend.launchers.registry import KINDS, LauncherKind, launcher_kind
from tidal.kernels.select import MODES
from tidal.launch import spawn
from tidal.launch.args import build_engine_config, flag_of
from tidal.launch.cli import make_generate_parser
from tidal.launch.connections import ServerLimits
from tidal.launch.engine_args import EngineArgs
from tidal.launch.scale_cli import make_parser as make_scale_parser

_SPECS = [*engine_options(), *option_specs(ServerLimits)]


def _bad_values(spec: OptionSpec) -> list[object]:
    """Values just outside what ``spec`` declares: one past each end of its range (and
    NaN and infinity for a float), a value not among its choices."""
    choices = choices_of(spec.arg_hint)
    if choices is not None:
        if isinstance(choices[0], str):
            return ["not-a-choice"]
        numbers = [c for c in choices if isinstance(c, int)]
        return [
            min(numbers) - 1,
            max(numbers) + 1,
            next(i for i in range(1, 999) if i not in numbers),
        ]
    base, meta = range_of(spec.arg_hint)
    assert meta is not None
    step = 1 if base is int else 0.5
    out: list[object] = []
    if meta.ge is not None:
        out.append(meta.ge - step)
    if meta.gt is not None:
        out.append(meta.gt)
    if meta.le is not None:
        out.append(meta.le + step)
    if meta.lt is not None:
        out.append(meta.lt)
    if base is float:
        out += [math.nan, math.inf]
    return out


_BOUNDED = [
    pytest.param(spec, bad, id=f"{spec.name}={bad}")
    for spec in _SPECS
    if choices_of(spec.arg_hint) is not None or range_of(spec.arg_hint)[1] is not None
    for bad in _bad_values(spec)
]


def _parsers() -> list[argparse.ArgumentParser]:
    return [spawn.make_parser(), make_generate_parser(), make_scale_parser()]


def test_every_flag_has_help():
    for parser in _parsers():
        for action in parser._actions:
            assert action.help and action.help.strip(), (parser.prog, action.option_strings)


def test_every_option_is_a_flag_with_its_declared_help():
    flags = {s for a in spawn.make_parser()._actions for s in a.option_strings}
    for spec in _SPECS:
        assert flag_of(spec.name) in flags, spec.name
        assert set(spec.option.aliases) <= flags, spec.name


def test_every_option_is_in_the_operations_guide():
    """docs/operations.md#serving-flags and #http-client-limits list every flag (by its
    name or an alias), so a new option is documented where operators look."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    for spec in _SPECS:
        spellings = (flag_of(spec.name), *spec.option.aliases)
        assert any(re.search(rf"[`/]{re.escape(s)}\b", doc) for s in spellings), spec.name


def test_engine_args_are_the_declared_options_once():
    names = [spec.name for spec in engine_options()]
    assert len(names) == len(set(names))  # one declaration per name
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    assert list(fields) == names
    for spec in engine_options():
        assert fields[spec.name].default == spec.default, spec.name


def test_the_suite_covers_the_bounded_options():
    """The generated cases are not empty by accident: a few options named here are in."""
    covered = {p.values[0].name for p in _BOUNDED}
    assert {"max_num_seqs", "block_size", "data_parallel_backend", "http_body_timeout"} <= covered


@pytest.mark.parametrize("spec,bad", _BOUNDED)
def test_out_of_range_flag_is_a_cli_error_naming_it(spec, bad, qwen3_ckpt, capsys):
    parser = spawn.make_parser()
    ns = parser.parse_args(["--model", qwen3_ckpt, flag_of(spec.name), str(bad)])
    with pytest.raises(SystemExit) as exc:
        spawn._server_limits(parser, ns)
        build_engine_config(parser, ns)
    assert exc.value.code == 2
    assert f"error: {flag_of(spec.name)}: {spec.name} must be" in capsys.readouterr().err


@pytest.mark.parametrize("spec,bad", [p for p in _BOUNDED if p.values[0] in engine_options()])
def test_out_of_range_argument_names_the_option(spec, bad, qwen3_ckpt):
    with pytest.raises(ValueError, match=f"^{spec.name} must be"):
        EngineArgs(model=qwen3_ckpt, **{spec.name: bad}).create_engine_config()


def test_configs_refuse_out_of_range_values():
    with pytest.raises(ValueError, match="^data_parallel_size must be an integer >= 1, got 0"):
        ParallelConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="^http_header_timeout must be a finite number > 0"):
        ServerLimits(header_timeout_s=math.inf)
    with pytest.raises(ValueError, match="^data_parallel_backend must be one of mp, ray"):
        dataclasses.replace(ParallelConfig(), data_parallel_backend="slurm")


def test_every_backend_choice_is_a_launcher_kind():
    """``--data-parallel-backend``'s declared choices and the registry's kinds are the same
    set; the choice names what each kind can do."""
    hint = typing.get_type_hints(ParallelConfig, include_extras=True)["data_parallel_backend"]
    assert set(choices_of(hint)) == set(KINDS)
    assert launcher_kind("ray").starts_all_ranks and launcher_kind("ray").headless_error
    assert not launcher_kind("mp").starts_all_ranks and launcher_kind("mp").headless_error is None
    with pytest.raises(ValueError, match="^data_parallel_backend must be one of mp, ray"):
        launcher_kind("slurm")


def test_cpu_kernels_choices_are_the_kernel_selectors_modes():
    hint = typing.get_type_hints(EngineArgs, include_extras=True)["cpu_kernels"]
    assert choices_of(hint) == MODES


class _Stub(Launcher):
    def start(self, engine_ids, handshake_address, *, warm):
        raise NotImplementedError

    def node_of(self, engine_id):
        return None

    def release(self, engine_id):
        pass

    def close(self):
        pass


@pytest.mark.parametrize(
    "kind,local,want",
    [(KINDS["mp"], 2, [0, 1]), (KINDS["mp"], 4, [0, 1, 2, 3]), (KINDS["ray"], 0, [0, 1, 2, 3])],
)
def test_launch_ranks_follow_the_kind(kind: LauncherKind, local, want):
    """A launcher that places every rank starts them all; otherwise this host's share
    (the first ``--data-parallel-size-local``), headless hosts the rest."""
    stub = type("Stub", (_Stub,), {"kind": kind})()
    stub.with_config(
        type(
            "Cfg",
            (),
            {"parallel": ParallelConfig(data_parallel_size=4, data_parallel_size_local=local)},
        )()
    )
    assert stub.launch_ranks([0, 1, 2, 3]) == want


def test_headless_is_refused_where_the_launcher_starts_every_rank(qwen3_ckpt, capsys):
    pytest.importorskip("ray")
    parser = spawn.make_parser()
    ns = parser.parse_args(["--model", qwen3_ckpt, "--headless", "--data-parallel-backend", "ray"])
    config = build_engine_config(parser, ns)
    with pytest.raises(SystemExit):
        spawn._check_multi_node(parser, ns, config)
    assert "--headless: not with --data-parallel-backend ray" in capsys.readouterr().err


def test_help_never_shows_a_secrets_default(monkeypatch):
    """The generated help appends defaults, except a ``repr=False`` option's: the auth
    key's default is the environment's secret."""
    secret = "env-secret-0123456789abcdef"
    monkeypatch.setenv("TIDAL_DP_AUTH_KEY", secret)
    text = spawn.make_parser().format_help()
    assert "--data-parallel-auth-key" in text and secret not in text
