"""Command line: ``launch`` (the server) and ``tidal`` (umbrella: serve, generate, scale).

The engine flags are ``tidal.launch.args``; ``launch``/``tidal serve`` is ``spawn.serve_main``;
``tidal scale`` is ``scale_cli.scale_main``.

The engine side (``llm``, ``spawn``: torch, the model code) is imported by the commands
that run it, not here: ``tidal scale`` is an HTTP client that starts in a fraction of the
seconds torch takes to import.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tidal.launch.scale_cli import scale_main


def make_generate_parser() -> argparse.ArgumentParser:
    from tidal.launch.args import add_engine_args

    p = argparse.ArgumentParser(prog="tidal generate", description="offline generation")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    p.add_argument(
        "--max-tokens",
        dest="gen_max_tokens",
        type=int,
        default=32,
        help="tokens to generate per prompt (default: %(default)s)",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default: greedy)"
    )
    add_engine_args(p)
    return p


def _generate_cmd(argv: list[str]) -> int:
    from tidal.launch.args import build_engine_config, engine_args_from
    from tidal.launch.llm import LLM
    from tidal.sampling_params import SamplingParams

    p = make_generate_parser()
    ns = p.parse_args(argv)
    build_engine_config(p, ns)  # validate flags before loading anything
    prompts = ns.prompt or ["The tide comes in", "Mixture of experts", "Hello"]
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    try:
        params = SamplingParams(max_tokens=ns.gen_max_tokens, temperature=ns.temperature)
        for out in llm.generate(prompts, params):
            c = out.outputs[0]
            print(f"{out.prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
    finally:
        llm.shutdown()
    return 0


def launch_main(argv: list[str] | None = None) -> int:
    from tidal.launch.spawn import serve_main

    return serve_main(sys.argv[1:] if argv is None else argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"generate": _generate_cmd, "serve": launch_main, "scale": scale_main}
    if not argv or argv[0] not in commands:
        print(
            "usage: tidal {serve,generate,scale} [options]  (tidal serve == launch; "
            "tidal scale --to N [--url URL] [--api-key KEY]: resize a running server)",
            file=sys.stderr,
        )
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
