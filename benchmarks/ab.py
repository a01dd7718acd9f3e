"""This tree against another commit of Tidal, in one run: offline throughput, online serving
and an elastic scale cycle. For refactors that must leave behaviour and speed alone.

    python benchmarks/ab.py --base fb6b5cb                 # 3 interleaved rounds
    python benchmarks/ab.py --base HEAD~5 --rounds 5 --only offline,scale

The base commit is extracted with ``git archive`` into a temporary directory (its C++
extensions copied over when their sources match, else built there; serving.py's
``previous_commit``) and removed at the end. Each round runs every benchmark once on each
side, the side that goes first alternating, so a burst of load from another process or a
drift of memory bandwidth hits both alike. Each side runs its own copy of the benchmark
script with its own tree first on ``PYTHONPATH``:

- ``offline``: ``offline_throughput.py --skip-hf --repeats 1`` (both cases; the in-process
  and the multiprocess engine): output tok/s.
- ``serving``: ``serving.py --launch --peer-ref <base> --rounds N`` from this tree: that
  script already alternates this tree's server and the base's; reported as it reports.
- ``scale``: ``elastic.py --quick --no-peer`` (2->3->2 under 8 streams): each operation's
  ``total_s`` and ``commit_pause_s``, and ``errors`` / ``lost`` (must be 0 on both sides).

Prints one JSON document: the machine, the two commits, and per metric both sides' values,
medians and the ratio head / base. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from serving import previous_commit  # noqa: E402 - a sibling module

BENCHMARKS = ("offline", "serving", "scale")


# Each side's CPU kernel choices (tidal/kernels/select.py) are cached under its own
# $XDG_CACHE_HOME for the run: measured afresh in the run's first round, the same quiet or
# busy minutes for both, never a choice one tree's cache kept from a noisier hour (on 2
# shared cores that alone moved single-stream throughput by 20 %).
_CACHE_HOMES: dict[Path, str] = {}


def _run(tree: Path, script: str, args: list[str], timeout_s: float) -> list[dict[str, Any]]:
    """Run ``tree``'s ``benchmarks/<script>`` with ``tree`` first on the path; its JSON output
    (one document, or one object per line) as a list of objects."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    if tree in _CACHE_HOMES:
        env["XDG_CACHE_HOME"] = _CACHE_HOMES[tree]
    cmd = [sys.executable, str(tree / "benchmarks" / script), *args]
    print(f"[ab] {tree.name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(
        cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed in {tree} (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = proc.stdout.strip()
    try:
        return [json.loads(out)]
    except json.JSONDecodeError:
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def offline_metrics(tree: Path) -> dict[str, float]:
    rows = _run(tree, "offline_throughput.py", ["--skip-hf", "--repeats", "1"], 1800)
    return {
        f"offline.{r['case']}.{r['engine']}.tok_per_s": r["tok_per_s_median"]
        for r in rows
        if "engine" in r
    }


def scale_metrics(tree: Path) -> dict[str, float]:
    (doc,) = _run(tree, "elastic.py", ["--quick", "--no-peer"], 1800)
    out: dict[str, float] = {}
    for row in doc["rows"]:
        if row["system"] != "tidal":
            continue
        for key in ("total_s", "commit_pause_s", "errors", "lost"):
            if row.get(key) is not None:
                out[f"scale.{row['op']}.{key}"] = row[key]
    return out


def _summary(values: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for metric, sides in sorted(values.items()):
        head, base = sides.get("head", []), sides.get("base", [])
        row: dict[str, Any] = {"head": head, "base": base}
        if head and base:
            h, b = statistics.median(head), statistics.median(base)
            row.update(head_median=h, base_median=b, head_over_base=round(h / b, 3) if b else None)
        table[metric] = row
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", required=True, help="git ref of the other side")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default=",".join(BENCHMARKS), help="comma list of " + "/".join(BENCHMARKS))
    args = p.parse_args(argv)
    only = [b.strip() for b in args.only.split(",") if b.strip()]
    for b in only:
        if b not in BENCHMARKS:
            p.error(f"--only: unknown benchmark {b!r} (one of {', '.join(BENCHMARKS)})")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")

    from tidal.kernels.select import cpu_description

    head_rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    base_rev = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    doc: dict[str, Any] = {
        "benchmark": "ab",
        "machine": {"cpu": cpu_description(), "load_avg_start": os.getloadavg()},
        "head": head_rev + ("+dirty" if _dirty() else ""),
        "base": base_rev,
        "rounds": args.rounds,
    }
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with (
        previous_commit(args.base) as base_tree,
        tempfile.TemporaryDirectory(prefix="ab-cache-") as caches,
    ):
        sides = {"head": REPO, "base": base_tree}
        for side, tree in sides.items():
            _CACHE_HOMES[tree] = str(Path(caches) / side)
        for r in range(args.rounds):
            order = ["head", "base"] if r % 2 == 0 else ["base", "head"]
            for bench, fn in (("offline", offline_metrics), ("scale", scale_metrics)):
                if bench not in only:
                    continue
                for side in order:
                    for metric, v in fn(sides[side]).items():
                        values[metric][side].append(v)
        if "serving" in only:
            (line,) = _run(
                REPO, "serving.py", ["--launch", "--peer-ref", args.base, "--rounds", str(args.rounds)], 3600
            )
            doc["serving"] = {
                "head": line["tidal"],
                "base": line["peer"],
                "head_over_base": line["tidal_over_peer"],
            }
    doc["metrics"] = _summary(values)
    doc["machine"]["load_avg_end"] = os.getloadavg()
    print(json.dumps(doc, indent=1), flush=True)
    return 0


def _dirty() -> bool:
    return bool(
        subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    )


if __name__ == "__main__":
    raise SystemExit(main())
