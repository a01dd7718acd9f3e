"""The dashboard in a real browser: headless Chromium loads ``/dashboard`` from a real
uvicorn server (a fake engine behind it), runs the page's JavaScript for a few seconds of
virtual time (several ``/stats`` polls), and the rendered DOM must show the fake data:
per-rank throughput (rates from successive polls), the expert-load heatmap per layer,
the scaling timeline with the rank count over time, and rank deaths: their markers, the
recovery operations set apart, and the degraded banner.

Needs a Chromium binary (Debian: ``apt-get install chromium``); skipped without one.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from html.parser import HTMLParser

import pytest

from tests.unit.test_api_server import live_server, run
from tests.unit.test_scale_api import ScalingFakeLLM, make_death, make_faults, make_record
from tidal.frontend.scaling.scale_records import ScaleTrigger

CHROMIUM = next(
    (
        path
        for path in (
            os.environ.get("TIDAL_CHROMIUM"),
            shutil.which("chromium"),
            shutil.which("chromium-browser"),
            shutil.which("google-chrome"),
        )
        if path
    ),
    None,
)
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None, reason="no chromium binary (apt-get install chromium, or TIDAL_CHROMIUM)"
    ),
]

# Rank i of the fake serves (i + 1) * 10 more requests (and 7x as many tokens) per poll.
ENGINE_IDS = [0, 2, 5]
EXPERT_LOAD = {"0": [5, 10, 40, 0, 7, 7, 7, 4], "1": [9, 9, 9, 9, 9, 9, 9, 9]}
CAUSE = "engine 6 did not start: <i>boom</i>"
DEGRADED = "engines [2] dead; recovering"
NODES = ("node-a-0123456789abcdef0123", "node-b")  # a Ray node id is long: shortened


class DashboardFakeLLM(ScalingFakeLLM):
    """/stats as a 3-rank elastic deployment after three operations; the counters grow
    with every call, as a serving deployment's do. With ``faults``: engine 1 died and the
    second operation (a recovery) removed it, engine 2 died since (degraded); without,
    ``/stats`` has no faults (null), as from an engine that does not report them."""

    def __init__(self, per_rank_tokens: bool, faults: bool = True) -> None:
        super().__init__(len(ENGINE_IDS))
        self.engine_ids = list(ENGINE_IDS)
        self.per_rank_tokens = per_rank_tokens
        self.polls = 0
        self.history = [
            make_record("grow-1", 1, 2, 4, started_at=1000.0, engine_ids=[0, 1]),
            make_record(
                "shrink-2",
                2,
                4,
                3,
                started_at=1030.0,
                engine_ids=[0, 1, 2, 3],
                dead=(1,),
                trigger=ScaleTrigger.RECOVERY,
            ),
            make_record("grow-3", 3, 3, 4, result="rolled_back", started_at=1060.0, cause=CAUSE),
        ]
        deaths = [
            make_death(1, 1028.0, migrated=4, recovered_by="shrink-2", recovery_s=5.7),
            make_death(2, 1080.0, epoch=2, migrated=2),
        ]
        self.faults = make_faults(deaths, degraded=DEGRADED, dead=[2]) if faults else None

    def fault_status(self) -> dict | None:
        return None if self.faults is None else super().fault_status()

    async def get_stats(self) -> dict:
        self.polls += 1
        ranks = []
        for r, e in enumerate(self.engine_ids):
            rank = {
                "rank": r,
                "engine_id": e,
                "waiting": r,
                "running": 2 * r + 1,
                "kv_usage": 0.1 * (r + 1),
                "requests_total": self.requests_total(r),
                "dead": False,
                "history": [[2.0, 0, 1], [1.0, r, 2 * r], [0.0, r, 2 * r + 1]],
            }
            if self.per_rank_tokens:
                rank["generation_tokens_total"] = 7 * self.requests_total(r)
                # Ranks 0 and 2 on one node, rank 1 on another: grouped by node.
                rank["node"] = NODES[r % 2]
            ranks.append(rank)
        for lg in self.loggers:  # the server's own token counters grow too
            lg.record_tokens(3, 50)
        return {
            "data_parallel_size": len(self.engine_ids),
            "epoch": 3,
            "wave": 4,
            "engines_running": True,
            "waves_completed": 4,
            "ranks": ranks,
            "expert_load": EXPERT_LOAD,
            "expert_load_by_engine": {"0": 30.0, "1": 10.0},
        }

    def requests_total(self, rank: int) -> int:
        return 100 + (rank + 1) * 10 * self.polls


class Elements(HTMLParser):
    """Every start tag of the dumped DOM with its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def find(self, tag: str | None = None, **attrs: str) -> list[dict[str, str]]:
        want = {k.replace("_", "-"): v for k, v in attrs.items()}
        return [
            a
            for t, a in self.tags
            if (tag is None or t == tag) and all(a.get(k) == v for k, v in want.items())
        ]

    def one(self, tag: str | None = None, **attrs: str) -> dict[str, str]:
        (found,) = self.find(tag, **attrs)
        return found


async def render(url: str) -> str:
    with tempfile.TemporaryDirectory(prefix="tidal-chromium-") as profile:
        proc = await asyncio.create_subprocess_exec(
            CHROMIUM,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            # The page polls /stats every second: 5 s of virtual time (which stands still
            # while a fetch is in flight) is 5-6 polls, enough for rates.
            "--virtual-time-budget=5000",
            "--dump-dom",
            url,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 120)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


# Without per-rank tokens, /stats is as older servers sent it: no faults either.
@pytest.mark.parametrize("per_rank_tokens", [False, True], ids=["stats-as-today", "tokens"])
@run
async def test_dashboard_renders_throughput_heatmap_and_timeline(per_rank_tokens):
    engine = DashboardFakeLLM(per_rank_tokens, faults=per_rank_tokens)
    async with live_server(engine) as url:
        dom = await render(url + "/dashboard")
    page = Elements()
    page.feed(dom)
    polls = int(page.one("body")["data-polls"])
    assert polls >= 3, dom[-3000:]

    # Per-rank throughput: one card per engine, in rank order (grouped by node when the
    # ranks say theirs: a heading per node), with rates from the polls.
    cards = page.find("div", **{"class": "card"})
    order = [0, 2, 1] if per_rank_tokens else [0, 1, 2]
    assert [c["data-engine-id"] for c in cards] == [str(engine.engine_ids[r]) for r in order]
    assert [c["data-rank"] for c in cards] == [str(r) for r in order]
    heads = page.find("div", **{"class": "node"})
    assert [h["data-node"] for h in heads] == (list(NODES) if per_rank_tokens else [])
    tputs = page.find("div", **{"class": "stat tput"})
    assert len(tputs) == 3
    totals = [int(t["data-requests-total"]) for t in tputs]
    assert totals == [engine.requests_total(r) for r in order]  # the last poll's
    req = dict(zip(order, (float(t["data-requests-per-s"]) for t in tputs)))
    assert all(r > 0 for r in req.values()), req
    assert req[1] / req[0] == pytest.approx(2) and req[2] / req[0] == pytest.approx(3)
    if per_rank_tokens:
        toks = [float(t["data-tokens-per-s"]) for t in tputs]
        assert [t / req[r] for t, r in zip(toks, order)] == pytest.approx([7, 7, 7])
        assert "tokens/s ·" in dom
    else:
        assert all("data-tokens-per-s" not in t for t in tputs)
        assert "no per-rank token counter" in dom
    overall = page.one("div", id="throughput")
    assert float(overall["data-tokens-per-s"]) > 0
    assert int(overall["data-generation-tokens-total"]) == 50 * engine.polls

    # Expert-load heatmap: a row per layer, a cell per expert with its count.
    heat = page.one("svg", id="heatmap")
    assert (heat["data-layers"], heat["data-experts"]) == ("2", "8")
    cells = page.find("rect", **{"class": "cell"})
    assert len(cells) == 16
    for layer, counts in EXPERT_LOAD.items():
        got = [int(c["data-load"]) for c in cells if c["data-layer"] == layer]
        assert got == counts
    imb = {
        g["data-layer"]: float(g["data-imbalance"]) for g in page.find("g", **{"class": "layer"})
    }
    assert imb == {"0": pytest.approx(4.0), "1": pytest.approx(1.0)}
    # Per engine: the tokens its experts computed and the busiest over the mean.
    loads = {
        e["data-engine"]: float(e["data-tokens"])
        for e in page.find("span", **{"class": "engine-load"})
    }
    assert loads == {"0": 30.0, "1": 10.0}
    assert float(page.one("div", id="rank-balance")["data-imbalance"]) == pytest.approx(1.5)
    hot = page.one("rect", data_layer="0", data_expert="2")
    cold = page.one("rect", data_layer="0", data_expert="3")
    assert hot["fill"] != cold["fill"]

    # Scaling timeline: the operations and the rank count over time.
    timeline = page.one("svg", id="timeline")
    assert timeline["data-ops"] == "3"
    ops = {g["data-operation-id"]: g for g in page.find("g", **{"class": "op"})}
    assert {k: (g["data-from"], g["data-to"], g["data-result"]) for k, g in ops.items()} == {
        "grow-1": ("2", "4", "succeeded"),
        "shrink-2": ("4", "3", "succeeded"),
        "grow-3": ("3", "4", "rolled_back"),
    }
    triggers = {k: g["data-trigger"] for k, g in ops.items()}
    assert triggers == {"grow-1": "api", "shrink-2": "recovery", "grow-3": "api"}
    # The recovery is outlined and labelled as one; a caller's operation is not.
    recovery_bar = page.one("rect", stroke="#8250df")
    assert "fill" in recovery_bar and len(page.find("text", **{"class": "t-recovery"})) == 1
    line = page.one("path", id="rank-line")
    assert (line["data-sizes"], line["data-current"]) == ("2,4,3", "3")
    assert page.one("text", **{"class": "death"})["data-engine-id"] == "1"
    rows = page.find("tr", data_result="rolled_back")
    assert [r["data-operation-id"] for r in rows] == ["grow-3"]
    assert [r["data-operation-id"] for r in page.find("tr") if "data-operation-id" in r] == [
        "grow-3",
        "shrink-2",
        "grow-1",
    ]
    assert page.one("div", id="scaling-status")["data-is-scaling"] == "false"
    check_faults(page, dom, engine.faults is not None)
    # Server text is shown as text, never parsed as HTML.
    assert "&lt;i&gt;boom&lt;/i&gt;" in dom and not page.find("i")


def check_faults(page: Elements, dom: str, faults: bool) -> None:
    """Rank deaths on the timeline and in their table, and the degraded banner (none of
    it when /stats has no faults)."""
    banner = page.one("div", id="degraded")
    timeline = page.one("svg", id="timeline")
    markers = {g["data-engine-id"]: g for g in page.find("g", **{"class": "rank-death"})}
    rows = page.find("tr", data_engine_id="1") + page.find("tr", data_engine_id="2")
    if not faults:
        assert "hidden" in banner and banner["data-degraded"] == "false"
        assert timeline["data-deaths"] == "0" and not markers and not rows
        assert "hidden" in page.one("table", id="deaths")
        return
    assert "hidden" not in banner and banner["data-degraded"] == "true"
    assert f"Degraded: {DEGRADED} · 2 engine(s) serving · 2 rank death(s), 1 recovered" in dom
    assert timeline["data-deaths"] == "2"
    assert {e: g["data-recovered-by"] for e, g in markers.items()} == {"1": "shrink-2", "2": ""}
    assert len(page.find("line", **{"class": "recovery-span"})) == 1  # only 1 recovered
    assert [r["data-recovered-by"] for r in rows] == ["shrink-2", ""]
    assert "hidden" not in page.one("table", id="deaths")
    assert "✖ engine 1" in dom and "✖ engine 2" in dom and "5.70 s" in dom
