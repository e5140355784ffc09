"""Text and JSON rendering of library results. Writes to a given file object only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO, Any

from keytrace.analysis.results import NO_VERDICT
from keytrace.analysis.summary import Summary
from keytrace.judge import definitions as d
from keytrace.judge.trust import agree_claim, trust_line


def fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def plural(n: int, noun: str) -> str:
    """``n`` and its noun, singular for one: ``plural(1, "episode")`` is "1 episode",
    ``plural(2_000, "episode")`` "2,000 episodes" (nouns that take an s)."""
    return f"{n:,} {noun if n == 1 else noun + 's'}"


def sweep_line(rows: Sequence[Any]) -> str:
    """`keytrace sweep`'s one summary line over its rows (`keytrace.analysis.sweep.SweepRow`):
    how many lengths mismatch, and where (binding groups and causes)."""
    bad = [r for r in rows if r.verdict == "mismatch"]
    line = f"{len(bad)} of {plural(len(rows), 'length')} mismatch"
    if bad:
        groups = sorted({r.binding_group for r in bad if r.binding_group is not None})
        causes = sorted({r.cause or "?" for r in bad})
        line += f": binding group {', '.join(map(str, groups))}, cause {', '.join(causes)}"
    unjudged = sum(r.verdict == NO_VERDICT for r in rows)
    if unjudged:
        line += f" ({plural(unjudged, 'length')} not judged: no rules for this geometry)"
    return line


def render_header(header: dict[str, Any], file: IO[str]) -> None:
    scalars = {k: v for k, v in header.items() if k not in ("groups", "lookup_order")}
    for k in sorted(scalars):
        file.write(f"{k:30} {scalars[k]}\n")
    file.write(f"{'lookup_order':30} {header.get('lookup_order')}\n")
    file.write("groups:\n")
    cols = (
        "group_id",
        "kind",
        "block_size",
        "tokens_per_chunk",
        "hashes_per_chunk",
        "sliding_window",
        "window_chunks",
        "extra_retained_tokens",
        "is_eagle",
        "offloaded",
    )
    file.write("  " + "  ".join(f"{c:>12}" for c in cols) + "\n")
    for g in header.get("groups", []):
        file.write("  " + "  ".join(f"{g.get(c)!s:>12}" for c in cols) + "\n")


SUMMARY_ROWS = {
    "store": "store events",
    "lookup": "key lookups",
    "episode": "episodes",
    "load": "load events",
    "step": "step rows",
}
"""What each of `Summary.rows` counts, in words (a lookup part's row holds a whole scan:
the count is of keys looked up, not of rows on disk)."""


def render_summary(s: Summary, file: IO[str]) -> None:
    h = s.header
    file.write(
        f"trace: {plural(s.parts, 'part')} from {plural(s.instances, 'recorder instance')}; "
        f"vLLM {h.get('vllm_version')}"
        + (" (not a verified release)" if h.get("vllm_verified") is False else "")
        + ", "
        f"model {h.get('model')}, blocks_per_chunk {h.get('blocks_per_chunk')}\n"
    )
    if h.get("sample"):
        file.write(
            f"sampled: every row of {h['sample']:.2%} of prefix chains (KEYTRACE_SAMPLE), "
            "plus what other chains' verdicts read across chains (docs/diff.md)\n"
        )
    file.write(
        "recorded: "
        + ", ".join(f"{SUMMARY_ROWS.get(k, k)} {fmt_int(v)}" for k, v in s.rows.items())
        + "\n\n"
    )
    file.write(
        f"{'group':>5}  {'kind':<9} {'tpc':>5}  {'stored':>8} {'prepared':>8} {'not new':>8} "
        f"{'evicted':>7}  {'lookups':>8} {'HIT':>8} {'MISS':>8} {'PENDING':>7} {'RETRY':>5}\n"
    )
    for g in s.groups:
        file.write(
            f"{g.group_id:>5}  {g.label:<9} {fmt_int(g.tokens_per_chunk):>5}  {fmt_int(g.stored):>8} "
            f"{fmt_int(g.prepared):>8} {fmt_int(g.rejected):>8} {fmt_int(g.evicted):>7}  "
            f"{fmt_int(g.looked_up):>8} {fmt_int(g.hits):>8} {fmt_int(g.misses):>8} "
            f"{fmt_int(g.pending):>7} {fmt_int(g.retries):>5}\n"
        )
    file.write(
        "(not new: offered to the store path and not written because the key was already "
        "stored, being stored, or under store_threshold)\n"
    )
    if s.episodes:
        file.write(f"\nepisodes (first {len(s.episodes)}):\n")
        w = max(12, *(len(e.req_id) for e in s.episodes))  # a server's ids run to 32+
        file.write(
            f"  {'request':<{w}} {'prompt':>8} {'local':>8} {'external':>9} {'accepted':>9}\n"
        )
        for e in s.episodes:
            ext = "deferred" if e.external_tokens is None else fmt_int(e.external_tokens)
            file.write(
                f"  {e.req_id:<{w}} {fmt_int(e.num_prompt_tokens):>8} "
                f"{fmt_int(e.local_tokens):>8} {ext:>9} {fmt_int(e.accepted_tokens):>9}\n"
            )


def _ranges_text(rs: list[tuple[int, int]]) -> str:
    if not rs:
        return "nothing"
    return ", ".join(f"{a:,}" if a == b else f"{a:,}–{b:,}" for a, b in rs)


def render_episode(v: Any, file: IO[str], *, header: dict[str, Any]) -> None:
    """Human evidence for one evaluated episode (a `keytrace.analysis.diff.EpisodeVerdict`)."""
    from keytrace.analysis.diff import CAUSE_TEXT
    from keytrace.judge.definitions import LIMIT_LABELS

    ext = "deferred" if v.external_tokens is None else f"{v.external_tokens:,}"
    where = f"request {v.req_id} (engine {v.engine_id or '?'}, rank {v.dp_rank}, step {v.step})"
    e_txt = "-" if v.E is None else f"{v.E:,}"
    limit = getattr(v, "limit", None)
    label = LIMIT_LABELS.get(limit, limit) if limit else ""
    named = (
        ""
        if not limit
        else f" ({label})"
        if v.verdict == "limited"
        else f" (judged under the request's cap; past it {label})"
    )
    file.write(
        f"{v.verdict.upper()}{named}: {where}: {v.num_prompt_tokens:,} prompt tokens, local {v.S:,}, "
        f"external {ext}, expected boundary E={e_txt} (cap L={v.L:,})\n"
    )
    if v.reason:
        file.write(f"  why: {v.reason}\n")
    if v.terminal is not None:
        t = v.terminal
        rng = (
            ""
            if t.chunk is None
            else f"chunk {t.chunk:,} (tokens {t.token_start:,}–{t.token_end:,})"
        )
        file.write(
            f"  binding group {v.binding_group} ({v.binding_label}); terminal key {rng} "
            f"looked up as {t.result}: {CAUSE_TEXT.get(t.cause, t.cause)}\n"
        )
    if v.binding_group is not None and v.E is not None:
        need = [n for n in v.needed if n.group_id == v.binding_group]
        if need:
            lo, hi = need[0].chunk, need[-1].chunk
            span = f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
            file.write(
                f"  group {v.binding_group} ({v.binding_label}) needed chunks {span} for a hit at "
                f"{v.E:,}; store wrote {_ranges_text(v.stored_chunks)} near there\n"
            )
    absent = [n for n in v.needed if d.absent(n.cause)]
    unknown = sum(1 for n in v.needed if n.cause == d.UNSEEN)
    for n in absent[:12]:
        res = n.lookup_result or "not looked up"
        file.write(
            f"    group {n.group_id} chunk {n.chunk:,} [{n.token_start:,}, {n.token_end:,}): lookup {res}; "
            f"{CAUSE_TEXT.get(n.cause, n.cause)}\n"
        )
    if len(absent) > 12:
        more = plural(len(absent) - 12, "more absent chunk")
        file.write(f"    ... {more} (use --json for all)\n")
    if unknown:
        file.write(
            f"    ({plural(unknown, 'needed chunk')} of groups the scan never reached; keys unknown)\n"
        )


def render_diff(report: Any, file: IO[str]) -> None:
    """Verdict line first, then evidence per reported episode."""
    partial = " (on INCOMPLETE evidence)" if report.evidence_incomplete else ""
    rules = trust_line(report.rules)
    if rules is not None:
        file.write(rules + "\n")
    for f in getattr(report, "identity", []):  # engines compared before any key
        file.write(f"MISMATCH{partial}: {f.text}\n")
    if report.verdict == NO_VERDICT:
        n = sum(report.counts.values())
        file.write(
            f"recorded: {plural(n, 'lookup episode')}; none judged (`--json` has what the rules "
            "would say where they do not apply, for whoever writes the missing ones)\n"
        )
        return
    if report.first_mismatch is not None and report.first_mismatch.verdict == "stalled":
        v = report.first_mismatch
        file.write(f"STALLED{partial}: request {v.req_id}: {v.reason} (E={fmt_int(v.E)})\n")
    elif report.first_mismatch is not None:
        v = report.first_mismatch
        t = v.terminal
        key_txt = (
            "" if t is None or t.chunk is None else f", terminal chunk {t.chunk:,} ({t.result})"
        )
        file.write(
            f"MISMATCH{partial}: request {v.req_id} got {v.external_tokens:,} external tokens, expected "
            f"{(v.E or 0) - v.S:,} (E={v.E:,}); binding group {v.binding_group} ({v.binding_label}){key_txt}\n"
        )
    elif report.verdict == "mismatch" and not getattr(report, "identity", []):
        file.write(
            f"MISMATCH{partial}: cold episodes did not read what a shared tier held for them "
            "(the token table's 'cold: on a shared tier this engine should have read')\n"
        )
    elif report.verdict != "mismatch":
        n = sum(report.counts.values())
        of = " of the sampled chains" if report.sample is not None else ""
        claim = agree_claim(report.rules)
        file.write(f"{claim}{partial}: no store/lookup mismatch in {plural(n, 'episode')}{of}\n")
    if report.sample is not None:
        file.write(
            f"sampled trace (KEYTRACE_SAMPLE={report.sample:g}): every row of "
            f"{report.sample:.2%} of prefix chains, chosen by their first block hash; verdicts "
            "and token counts are exact for those chains and say nothing of the others\n"
        )
    if report.counts:
        file.write(
            "episodes: " + ", ".join(f"{k} {n}" for k, n in sorted(report.counts.items())) + "\n"
        )
    if report.evidence_incomplete:
        file.write(
            "evidence incomplete: parts are unreadable or missing, or requests lack their "
            "lookups (see the warnings); the verdict covers only what is here\n"
        )
    shown = report.episodes if report.all_episodes else [v for v in [report.first_mismatch] if v]
    for v in shown:
        file.write("\n")
        render_episode(v, file, header=report.header)
    hidden = len(report.episodes) - len(shown)
    if hidden > 0 and not report.all_episodes:
        more = plural(hidden, "more shortfall episode")
        file.write(f"\n({more} not shown; --all lists every episode)\n")
    if report.lost is not None:
        file.write("\n")
        render_lost(report.lost, file, header=report.header)


MAX_ENGINE_COLUMNS = 4
MAX_RULE_ROWS = 3
"""RULE rows of the lost-token table shown under each engine (``--json`` has them all)."""


def render_fleet(fleet: Any, file: IO[str]) -> None:
    """``keytrace diff --by engine``: the whole trace's verdict, then one line per engine,
    worst first (findings, then RULE tokens lost), its first finding and RULE causes. The
    verdict columns are every verdict there is (`BASE_VERDICTS`, `SHORTFALL_VERDICTS`), so
    they add up to the episodes."""
    partial = " (on INCOMPLETE evidence)" if fleet.evidence_incomplete else ""
    rules = getattr(fleet, "rules", None)
    first = trust_line(rules)
    if first is not None:
        file.write(first + "\n")
    if fleet.verdict != NO_VERDICT:
        bad = [e for e in fleet.engines if e.mismatches]
        head = "MISMATCH" if fleet.verdict == "mismatch" else agree_claim(rules)
        n = len(fleet.engines)
        file.write(f"{head}{partial}: {len(bad)} of {plural(n, 'engine')} with mismatches\n")
    for f in getattr(fleet, "identity", []):  # engines compared before any key
        file.write(f"MISMATCH{partial}: {f.text}\n")
    if fleet.verdict == NO_VERDICT:
        return
    if fleet.sample is not None:
        file.write(
            f"sampled trace (KEYTRACE_SAMPLE={fleet.sample:g}): counts cover the sampled "
            "prefix chains only\n"
        )
    width = max([len(e.engine) for e in fleet.engines] + [6])
    columns = ("mismatch", "stalled", "explained", "deferred", "hit", "limited", "cold")
    file.write(
        f"{'engine':<{width}}  {'episodes':>8} "
        + " ".join(f"{c:>9}" for c in columns)
        + f"  {'RULE tokens':>11}\n"
    )
    for e in fleet.engines:
        c = e.counts
        file.write(
            f"{e.engine:<{width}}  {fmt_int(sum(c.values())):>8} "
            + " ".join(f"{fmt_int(c.get(k, 0)):>9}" for k in columns)
            + f"  {fmt_int(e.rule_tokens):>11}\n"
        )
        v = e.first_mismatch
        if v is not None and v.verdict == "stalled":
            file.write(f"  first: request {v.req_id} STALLED: {v.reason} (E={fmt_int(v.E)})\n")
        elif v is not None:
            t = v.terminal
            where = "" if t is None or t.chunk is None else f", chunk {t.chunk:,} ({t.result})"
            cause = "" if t is None or t.cause is None else f": {t.cause}"
            file.write(
                f"  first: request {v.req_id}, group {v.binding_group}{where}{cause}; "
                f"got {fmt_int(v.external_tokens)} external tokens, E={fmt_int(v.E)}\n"
            )
        for r in e.rule_rows[:MAX_RULE_ROWS]:
            group = "" if r.group is None else f" group {r.group}"
            file.write(
                f"  RULE {r.cause}{group}: {plural(r.tokens, 'token')} in "
                f"{plural(r.episodes, 'episode')}\n"
            )
        if len(e.rule_rows) > MAX_RULE_ROWS:
            more = plural(len(e.rule_rows) - MAX_RULE_ROWS, "more RULE row")
            file.write(f"  ... {more} (--json)\n")


def render_lost(lost: Any, file: IO[str], *, header: dict[str, Any]) -> None:
    """Where the prompt tokens came from: one row per category, one column per engine
    (up to four, then only the total; --json has them all), tokens and share."""
    from keytrace.judge.rules import groups_from_header

    labels = {g.gid: g.label for g in groups_from_header(header)}
    tier_types = {t.get("index"): t.get("type") for t in header.get("secondary_tiers") or []}
    engines = [e for e in lost.prompt_tokens if e != "all"]
    columns = (engines if len(engines) <= MAX_ENGINE_COLUMNS else []) + ["all"]
    if len(columns) == 2:  # one engine: its column is the total
        columns = ["all"]
    total = lost.prompt_tokens.get("all", 0)
    file.write(
        f"where the tokens to prefill came from ({plural(lost.episodes.get('all', 0), 'lookup')}, "
        f"{plural(total, 'token')}):\n"
    )
    from keytrace.analysis.lost import CATEGORIES

    keys = sorted(
        {(r.category, r.cause, r.group, r.tier) for r in lost.rows},
        key=lambda k: (
            CATEGORIES.index(k[0]),
            str(k[1]),
            k[2] if k[2] is not None else -1,
            k[3] if k[3] is not None else -1,
        ),
    )
    cell: dict[tuple[Any, ...], int] = {
        (r.engine, r.category, r.cause, r.group, r.tier): r.tokens for r in lost.rows
    }
    names = {}
    for k in keys:
        row = next(r for r in lost.rows if (r.category, r.cause, r.group, r.tier) == k)
        label = row.label
        if row.group is not None:
            label += f" ({labels.get(row.group, '?')})"
        if row.tier is not None:
            label += f" ({tier_types.get(row.tier, '?')})"
        names[k] = label
    width = max([len(n) for n in names.values()] + [10])
    head = "".join(f"{_engine_name(c):>24}" for c in columns)
    file.write(f"  {'':<{width}}{head}\n")
    for k in keys:
        line = ""
        for c in columns:
            tok = cell.get((c, *k), 0)
            share = 100 * tok / lost.prompt_tokens[c] if lost.prompt_tokens.get(c) else 0.0
            line += f"{tok:>16,} {share:>5.1f}% " if tok else f"{'-':>24}"
        file.write(f"  {names[k]:<{width}}{line.rstrip()}\n")


def _engine_name(engine: str) -> str:
    return "all engines" if engine == "all" else f"engine {engine[:8]}"


def render_doctor(d: dict[str, Any], file: IO[str], *, checks: bool = False) -> None:
    """``keytrace doctor``: the environment, the installed vLLM, then one line per
    capability (what works, and for what does not, why); every check with ``checks``."""
    vllm = d["vllm"]
    libs = d["libraries"]
    file.write(f"keytrace {d['keytrace']} on Python {d['python']} ({d['platform']})\n")
    file.write(
        "libraries: "
        + ", ".join(f"{k} {v}" for k, v in libs.items() if k not in ("keytrace", "vllm") and v)
        + "\n"
    )
    missing = [k for k, v in libs.items() if v is None and k != "vllm"]
    if missing:
        file.write(f"not installed: {', '.join(missing)}\n")
    if vllm["version"] is None:
        file.write(f"vLLM: not importable ({vllm['error']})\n")
    else:
        file.write(f"vLLM: {vllm['version']} ({vllm['kind']}) at {vllm['path']}\n")
    file.write(
        f"releases keytrace's CI records on: {', '.join(d['verified_releases'])} "
        "(whether its rules hold there: judge, below)\n\n"
    )
    width = max(len(c["name"]) for c in d["capabilities"])
    for c in d["capabilities"]:
        mark = "yes" if c["ok"] else "NO "
        what = c["what"] if len(c["what"]) <= 64 else c["what"][:61] + "..."
        line = f"  {mark}  {c['name']:<{width}}  {what}"
        file.write(line + ("" if c["ok"] else f"\n{'':<{width + 9}}why: {c['reason']}") + "\n")
        if checks:
            for k in c["checks"]:
                file.write(f"{'':<{width + 9}}{'ok' if k['ok'] else 'FAILED'}: {k['check']}\n")
    for note in d["notes"]:
        file.write(f"\nnote: {note}\n")
    for warning in d.get("identity_warnings") or []:
        file.write(f"\nwarning: {warning}\n")
    file.write(
        "\nrecording works here\n" if d["can_record"] else "\nrecording does NOT work here\n"
    )


def render_verify(out: Any, file: IO[str]) -> None:
    """``keytrace doctor --verify``: what the oracle checked on the installed code."""
    file.write(
        f"vLLM {out.vllm} (rules digest {out.digest}): "
        f"{plural(out.episodes, 'shortfall episode')} of {plural(out.workloads, 'workload')} "
        f"looked up again in isolation in {out.seconds:.0f}s, "
        f"{plural(len(out.disagreements), 'disagreement')}\n"
    )
    for line in out.disagreements:
        file.write(f"  DISAGREES: {line}\n")
    for line in out.skipped:
        file.write(f"  skipped: {line}\n")
    if out.disagreements:
        file.write("rules DISPUTED on this code: traces recorded on it get no AGREE\n")
    elif out.episodes:
        file.write("rules verified on this code: kept for the traces it records\n")
