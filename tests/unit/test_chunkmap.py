"""The chunk map data (`keytrace.analysis.chunkmap`) and its page (`keytrace.report.html`) on
hand-built traces: what each chunk shows, and that the page is self-contained."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from keytrace.analysis.diff import diff
from keytrace.format.reader import open_trace
from keytrace.report.html import render_html
from tests.factories import TINY, new_builder

FA_ALL = [(c, "HIT") for c in range(6)]


def two_shortfalls(d: Path) -> Path:
    """r2: mismatch (group 1 chunk 4 never offered); r5: explained (chunk 4 evicted)."""
    b = new_builder(d, geometry=TINY.with_(groups=TINY.groups[:2]))
    b.prime("r1", "c", 100, swa_chunks={1: [5]})
    b.episode("r2", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, [(5, "HIT"), (4, "MISS")])])
    b.prime("r4", "d", 100, swa_chunks={1: [4, 5]})
    b.store("r4", "d", 1, [3], complete=False, job=7)
    b.evict("r9", "d", 1, [4])
    b.episode("r5", 100, external=0, chain="d", scans=[(0, FA_ALL), (1, [(5, "HIT"), (4, "MISS")])])
    b.close()
    return d


def _maps(tmp_path: Path):
    report = diff(open_trace(str(two_shortfalls(tmp_path / "t"))), maps=200)
    return report, report.maps


def _lane(m, gid):
    return {c.chunk: c for c in next(lane for lane in m.lanes if lane.group_id == gid).chunks}


def test_each_chunk_shows_store_state_lookup_need_and_the_terminal_key(tmp_path: Path) -> None:
    _, maps = _maps(tmp_path)
    assert [(m.episode.req_id, m.episode.verdict) for m in maps] == [
        ("r2", "mismatch"),
        ("r5", "explained"),
    ]
    swa = _lane(maps[0], 1)
    # E = 96: the window needs chunks 4 and 5; the store kept only 5
    c4, c5 = swa[4], swa[5]
    assert (c4.stored, c4.lookup, c4.needed, c4.cause, c4.terminal) == (
        None,
        "MISS",
        True,
        "never_offered",
        True,
    )
    assert (c5.stored, c5.lookup, c5.needed, c5.cause, c5.terminal) == (
        "resident",
        "HIT",
        True,
        "resident",
        False,
    )
    assert not any(c.terminal for k, c in swa.items() if k != 4)
    assert (swa[3].needed, swa[3].stored, swa[3].lookup) == (False, None, None)
    # the second episode: chunk 4 was written then evicted, chunk 3's store still in flight
    swa5 = _lane(maps[1], 1)
    assert (swa5[4].stored, swa5[4].cause, swa5[4].terminal) == ("evicted", "evicted", True)
    assert swa5[3].stored == "in_flight" and swa5[5].stored == "resident"
    fa = _lane(maps[0], 0)
    below_E = [c for c, x in fa.items() if x.token_end <= 96]
    assert below_E and all(fa[c].stored == "resident" and fa[c].lookup == "HIT" for c in below_E)
    assert all(fa[c].stored is None for c in fa if c not in below_E)  # 100 tokens: no chunk 6


def test_the_window_is_around_E_on_every_groups_chunk_boundaries(tmp_path: Path) -> None:
    _, maps = _maps(tmp_path)
    m = maps[0]
    assert m.token_lo <= 64 and m.token_hi >= 96 + 16
    assert m.token_lo % 16 == 0 and m.token_hi % 16 == 0
    for lane in m.lanes:
        assert [c.chunk for c in lane.chunks] == list(
            range(m.token_lo // lane.tokens_per_chunk, m.token_hi // lane.tokens_per_chunk)
        )


def test_limit_keeps_the_first_mismatch(tmp_path: Path) -> None:
    maps = diff(open_trace(str(two_shortfalls(tmp_path / "t"))), maps=1).maps
    assert [m.episode.req_id for m in maps] == ["r2"]


def test_page_is_self_contained_and_carries_the_data(tmp_path: Path) -> None:
    report, _ = _maps(tmp_path)
    out = io.StringIO()
    render_html(report, out)
    page = out.getvalue()
    # nothing fetched: no external scripts, styles, images or links
    assert not re.search(r"<(link|img|iframe)\b|\b(src|href)\s*=", page)
    assert "http" not in page.replace("http://www.w3.org/2000/svg", "")
    data = json.loads(
        re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)[1]
    )
    assert data["verdict"] == "mismatch"
    first = data["episodes"][0]
    assert (first["req_id"], first["terminal"]["group"], first["terminal"]["chunk"]) == ("r2", 1, 4)
    lane = next(x for x in first["lanes"] if x["group"] == 1)
    assert [c[:5] for c in lane["chunks"] if c[0] == 4] == [
        [4, None, "MISS", True, "never_offered"]
    ]
    rule = [r for r in data["lost"]["rows"] if r["rule"]]
    assert rule and rule[0]["tokens"] == 96


def test_data_cannot_end_the_script_element(tmp_path: Path) -> None:
    d = tmp_path / "t"
    b = new_builder(d, geometry=TINY.with_(groups=TINY.groups[:2]))
    b.prime("</script><b>r1", "c", 100, swa_chunks={1: [5]})
    b.episode(
        "</script><b>r2",
        100,
        external=0,
        chain="c",
        scans=[(0, FA_ALL), (1, [(5, "HIT"), (4, "MISS")])],
    )
    b.close()
    out = io.StringIO()
    render_html(diff(open_trace(str(d)), maps=200), out)
    assert out.getvalue().count("</script>") == 2  # the two script elements' own ends
    assert "</script><b>r2" not in out.getvalue()


def test_diff_html_option_writes_the_page(tmp_path: Path, capsys) -> None:
    from keytrace.cli import main

    d = two_shortfalls(tmp_path / "t")
    page = tmp_path / "map.html"
    assert main(["diff", str(d), "--html", str(page)]) == 1
    assert f"chunk map: {page}" in capsys.readouterr().out
    assert page.read_text().startswith("<!doctype html>")
    assert not list(tmp_path.glob("map.html.tmp*"))


def test_maps_come_with_the_report_and_stay_out_of_its_json(tmp_path: Path) -> None:
    import dataclasses

    from keytrace.report.jsonout import write_json

    trace = open_trace(str(two_shortfalls(tmp_path / "t")))
    plain, drawn = diff(trace), diff(trace, maps=200)
    assert plain.maps == [] and len(drawn.maps) == 2
    texts = []
    for r in (plain, drawn):
        out = io.StringIO()
        write_json(r, out)
        texts.append(out.getvalue())
    assert texts[0] == texts[1] and '"maps"' not in texts[0]
    assert dataclasses.replace(drawn, maps=[]) == plain


def _page_data(report) -> dict:
    out = io.StringIO()
    render_html(report, out)
    found = re.search(
        r'<script type="application/json" id="data">(.*?)</script>', out.getvalue(), re.S
    )
    assert found
    return json.loads(found[1])


def _with_header(d: Path, **extra: object) -> Path:
    """`two_shortfalls` recorded with a recorder's header (plus ``extra``)."""
    from keytrace.analysis.geometry import synthetic_header

    geo = TINY.with_(groups=TINY.groups[:2])
    header = {**synthetic_header(geo), "vllm_verified": False, **extra}
    b = new_builder(d, geometry=geo, header=header)
    b.prime("r1", "c", 100, swa_chunks={1: [5]})
    b.episode("r2", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, [(5, "HIT"), (4, "MISS")])])
    b.close()
    return d


def test_a_page_claims_no_verdict_where_the_rules_do_not_describe_the_trace(
    tmp_path: Path, monkeypatch
) -> None:
    """The text report says NO VERDICT and judges nothing on a trace the rules do not
    describe; the page says the same: no MISMATCH heading or badge, no cause, no token
    table, the rules line shown, what was recorded still drawn."""
    monkeypatch.setenv("KEYTRACE_CACHE_DIR", str(tmp_path / "cache"))
    from keytrace.analysis.geometry import synthetic_header

    groups = synthetic_header(TINY.with_(groups=TINY.groups[:2]))["groups"]
    state = {**groups[-1], "group_id": 7, "kind": "mamba", "requires_cow_source": True}
    d = _with_header(
        tmp_path / "t",
        rules_digest="00000000000000cc",
        retention_interval=512,  # a recurrent group with a retention interval: no rules
        groups=[*groups, state],
    )
    data = _page_data(diff(open_trace(str(d)), maps=200))
    assert data["headline"] == "NO VERDICT" and data["judged"] is False
    assert data["rules"].startswith("NO VERDICT: keytrace has no rules for what this trace holds")
    assert data["lost"] is None and data["counts"] == {"recorded, not judged": 2}
    [ep] = data["episodes"]
    assert (ep["req_id"], ep["verdict"], ep["reason"], ep["terminal"], ep["E"]) == (
        "r2",
        "unjudged",
        None,
        None,
        None,
    )
    assert (ep["binding_group"], ep["external"], ep["P"]) == (None, 0, 100)
    chunks = [c for lane in ep["lanes"] for c in lane["chunks"]]
    assert chunks and not any(c[3] or c[4] or c[6] for c in chunks)  # no need, cause, terminal
    assert [c[:3] for c in chunks if c[2] == "MISS"] == [[4, None, "MISS"]]  # recorded


def test_a_page_claims_no_agree_on_code_the_oracle_disputed(tmp_path: Path, monkeypatch) -> None:
    from keytrace.judge import trust

    monkeypatch.setenv("KEYTRACE_CACHE_DIR", str(tmp_path / "cache"))
    trust.record_run("00000000000000dd", trust.Verification("0.34.0", 40, 2, "t"))
    geo = TINY.with_(groups=TINY.groups[:2])
    from keytrace.analysis.geometry import synthetic_header

    header = {**synthetic_header(geo), "vllm_verified": False, "rules_digest": "00000000000000dd"}
    b = new_builder(tmp_path / "t", geometry=geo, header=header)
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5]})
    b.episode("r2", 100, external=96, chain="c", scans=[(0, FA_ALL), (1, [(5, "HIT"), (4, "HIT")])])
    b.close()
    data = _page_data(diff(open_trace(str(tmp_path / "t")), maps=200))
    assert data["verdict"] == "agree" and data["headline"] == "NO VERDICT (rules disputed)"
    assert data["rules"].startswith("RULES DISPUTED: the oracle disagreed with keytrace 2 time")


def test_a_judged_page_heads_with_its_verdict(tmp_path: Path) -> None:
    report, _ = _maps(tmp_path)
    data = _page_data(report)
    assert (data["headline"], data["judged"], data["rules"]) == ("MISMATCH", True, None)
    assert {e["verdict"] for e in data["episodes"]} == {"mismatch", "explained"}
