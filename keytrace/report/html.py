"""`keytrace diff --html`: one self-contained page (inline CSS, SVG drawn by inline JS, data
as embedded JSON) with the verdict, the lost-token table and a chunk map per episode.

The page is a Jinja2 template (``templates/chunkmap.html.j2``); this module only turns the
analysis results into the JSON the page reads. No network: it opens from disk.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

from keytrace.analysis.lost import LostTokens
from keytrace.analysis.results import NO_VERDICT, DiffReport, EpisodeMap
from keytrace.judge.trust import agree_claim, trust_line
from keytrace.report.templates import render


def write_page(path: str, report: DiffReport) -> None:
    """`render_html` into ``path``, through a temporary name and an atomic rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        render_html(report, fh)
    os.replace(tmp, path)


def headline(report: DiffReport) -> str:
    """What the page claims, as the text report does: NO VERDICT where the rules do not
    describe the trace or the oracle disputed them (never an AGREE then), else the verdict."""
    partial = " (on INCOMPLETE evidence)" if report.evidence_incomplete else ""
    if report.verdict == NO_VERDICT and not report.identity:
        return "NO VERDICT"
    if report.verdict == "mismatch" or report.identity:
        first = report.first_mismatch
        stalled = first is not None and first.verdict == "stalled" and not report.identity
        return ("STALLED" if stalled else "MISMATCH") + partial
    return agree_claim(report.rules) + partial


def page_data(report: DiffReport) -> dict[str, Any]:
    """What the page shows, as the JSON it embeds: the claim and the rules line the text
    report starts with, counts, header, lost-token table and the report's chunk maps
    (``diff(..., maps=N)``), drawn in that order. A trace the rules do not describe is
    drawn as recorded (what was stored and looked up), with no verdict, cause or token
    table: those come from the rules."""
    judged = report.verdict != NO_VERDICT  # as the text report: "none judged"
    recorded = sum(report.counts.values())
    return {
        "verdict": report.verdict,
        "headline": headline(report),
        "rules": trust_line(report.rules),
        "judged": judged,
        "counts": report.counts if judged else {"recorded, not judged": recorded},
        "header": {
            k: report.header.get(k) for k in ("vllm_version", "model", "geometry", "injected")
        },
        "lost": _lost(report.lost) if judged else None,
        "episodes": [_episode(m) if judged else _unjudged(_episode(m)) for m in report.maps],
        "total_shortfalls": report.counts.get("mismatch", 0) + report.counts.get("explained", 0),
    }


def _unjudged(ep: dict[str, Any]) -> dict[str, Any]:
    """An episode's map with what the rules would have said removed (verdict, reason, E,
    the binding group and its terminal key, the needed chunks and every cause), what was
    recorded kept (stored and looked-up chunks, keys, S, L, external tokens)."""
    lanes = [
        {**lane, "chunks": [[c[0], c[1], c[2], False, None, c[5], False] for c in lane["chunks"]]}
        for lane in ep["lanes"]
    ]
    return {
        **ep,
        "verdict": "unjudged",
        "reason": None,
        "E": None,
        "binding_group": None,
        "binding_label": None,
        "terminal": None,
        "lanes": lanes,
    }


def render_html(report: DiffReport, file: IO[str]) -> None:
    """Write the page for ``report`` with its chunk maps (the first mismatch, if any, is
    selected when the page opens)."""
    data = page_data(report)
    page = render(
        "chunkmap.html.j2",
        title=f"keytrace diff: {data['headline']}",
        data_json=_script_json(data),
    )
    file.write(page)


def _script_json(data: Any) -> str:
    # inside <script>, "</" would end the element and "<!--" start a comment: escape them
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _lost(lost: LostTokens | None) -> dict[str, Any] | None:
    if lost is None:
        return None
    total = lost.prompt_tokens.get("all", 0)
    rows: list[dict[str, Any]] = [
        {
            "label": r.label,
            "tokens": r.tokens,
            "episodes": r.episodes,
            "rule": r.category == "short" and not r.explained,
        }
        for r in lost.rows
        if r.engine == "all"
    ]
    rows.sort(key=lambda r: -r["tokens"])
    return {"prompt_tokens": total, "lookups": lost.episodes.get("all", 0), "rows": rows}


def _episode(m: EpisodeMap) -> dict[str, Any]:
    v = m.episode
    t = v.terminal
    return {
        "verdict": v.verdict,
        "req_id": v.req_id,
        "episode": v.episode,
        "engine": v.engine_id or v.instance,
        "rank": v.dp_rank,
        "P": v.num_prompt_tokens,
        "S": v.S,
        "L": v.L,
        "E": v.E,
        "external": v.external_tokens,
        "binding_group": v.binding_group,
        "binding_label": v.binding_label,
        "terminal": None
        if t is None
        else {
            "group": t.group_id,
            "chunk": t.chunk,
            "key": t.key,
            "result": t.result,
            "cause": t.cause,
        },
        "reason": v.reason,
        "lo": m.token_lo,
        "hi": m.token_hi,
        "lanes": [
            {
                "group": lane.group_id,
                "label": lane.label,
                "tpc": lane.tokens_per_chunk,
                "window": lane.sliding_window,
                "eagle": lane.eagle,
                # only chunks with something to show; the rest are drawn empty
                "chunks": [
                    [c.chunk, c.stored, c.lookup, c.needed, c.cause, c.key, c.terminal]
                    for c in lane.chunks
                    if c.stored or c.lookup or c.needed
                ],
                "first": lane.chunks[0].chunk if lane.chunks else 0,
                "count": len(lane.chunks),
            }
            for lane in m.lanes
        ],
    }
