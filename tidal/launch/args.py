"""Command-line flags generated from option declarations (tidal/config.py's ``option``):
every ``EngineArgs`` field becomes a ``--kebab-case`` flag with its aliases, its help (the
declared text, plus its choices, range and default), and errors naming the flag.

Shared by ``launch`` (spawn.py, which adds ``ServerLimits``' flags the same way) and ``tidal
generate`` (cli.py); it lives apart from both so neither imports the other for it (cli
dispatches to spawn).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable
from typing import Any

from tidal.config import (
    EngineConfig,
    OptionSpec,
    choices_of,
    describe_range,
    option_specs,
    range_of,
)
from tidal.launch.api_key import read_secret_file
from tidal.launch.engine_args import AUTH_KEY_ENV, EngineArgs

_ENV_DEFAULTS = {"data_parallel_auth_key": AUTH_KEY_ENV}
# Secrets that may come from a file instead (``--<flag>-file``), out of the process list.
_FILE_FLAGS = ("data_parallel_auth_key",)


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_option_args(parser, option_specs(EngineArgs))


def add_option_args(parser: argparse.ArgumentParser, specs: Iterable[OptionSpec]) -> None:
    """One flag per declared option (``dest`` its user-facing name). Choices and ranges
    are checked by ``check_options`` after parsing, so an error reads the same from the
    CLI and from ``LLM(**kwargs)``."""
    for spec in specs:
        flag = flag_of(spec.name)
        names = [flag, *spec.option.aliases]
        # Secrets come from the environment here and only here; the config carries them on.
        default = (
            os.environ.get(_ENV_DEFAULTS[spec.name], spec.default)
            if spec.name in _ENV_DEFAULTS
            else spec.default
        )
        help_ = help_text(spec)
        if spec.arg_hint is bool:
            parser.add_argument(
                *names,
                dest=spec.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_,
            )
        else:
            choices = choices_of(spec.arg_hint)
            parser.add_argument(
                *names,
                dest=spec.name,
                type=_scalar(spec.arg_hint),
                default=default,
                help=help_,
                metavar="{" + ",".join(map(str, choices)) + "}" if choices else None,
            )
        if spec.name in _FILE_FLAGS:
            parser.add_argument(
                f"{flag}-file",
                dest=f"{spec.name}_file",
                default=None,
                metavar="PATH",
                help=f"read {flag} from this file (its first line), out of the process list",
            )


def help_text(spec: OptionSpec) -> str:
    """The declared help, then what it takes and its default: ``(>= 1; default 128)``."""
    choices = choices_of(spec.arg_hint)
    _, meta = range_of(spec.arg_hint)
    notes = [" | ".join(map(str, choices))] if choices else []
    if meta is not None:
        notes.append(describe_range(meta))
    # A secret's default (the environment's) is never shown; None: the help says.
    default = spec.default
    if isinstance(default, bool):
        notes.append("default " + ("on" if default else "off"))
    elif spec.field.repr and default is not None:
        notes.append(f"default {default:g}" if isinstance(default, float) else f"default {default}")
    return spec.option.help + (f" ({'; '.join(notes)})" if notes else "")


def _scalar(hint: Any) -> Any:
    choices = choices_of(hint)
    if choices:
        return type(choices[0])
    base, _ = range_of(hint)
    return base if base in (int, float, str) else str


def _read_secret_files(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Fills each ``_FILE_FLAGS`` field from its file when one is given; the file wins
    over the environment variable, like a flag does, but not over the flag itself."""
    for name in _FILE_FLAGS:
        path = getattr(ns, f"{name}_file", None)
        if path is None:
            continue
        flag = flag_of(name)
        given = getattr(ns, name)
        if given != parser.get_default(name):  # the flag itself (its default: the variable)
            parser.error(f"{flag}-file: give either {flag} or {flag}-file, not both")
        setattr(ns, name, read_secret_file(parser, f"{flag}-file", path))


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def build_engine_config(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> EngineConfig:
    """EngineArgs -> EngineConfig, turning validation errors into CLI errors naming the flag.
    Secrets given as files are read here, into ``ns``."""
    _read_secret_files(parser, ns)
    try:
        return engine_args_from(ns).create_engine_config()
    except ValueError as e:
        field = str(e).split(" ", 1)[0].rstrip(":")
        known = field in {f.name for f in dataclasses.fields(EngineArgs)}
        parser.error(f"{flag_of(field)}: {e}" if known else str(e))
