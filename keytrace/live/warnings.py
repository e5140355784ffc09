"""What the live alarm says in the server's log: one line per new problem, everything a
developer needs to look at it, and the `keytrace diff` command that shows the evidence."""

from __future__ import annotations

import logging
import shlex

from keytrace.format.remote import shown
from keytrace.judge import definitions as d
from keytrace.judge.rules import Group
from keytrace.live.judged import Judged
from keytrace.live.state import InstanceState

log = logging.getLogger("keytrace")

Problem = tuple[str, int | None, str | None]
"""(engine, binding group, cause or "stalled"): what one warning is about."""


def details(st: InstanceState, req_id: str) -> str:
    """The command that shows a request's evidence, or how to get one."""
    if not st.directory:
        return "record a trace (KEYTRACE_DIR) and run keytrace diff on it"
    return f"keytrace diff {shlex.quote(shown(st.directory))} --request {shlex.quote(req_id)}"


def describe_mismatch(st: InstanceState, j: Judged, g: Group | None) -> str:
    """The warning of a write-only mismatch (``g``: its binding group)."""
    where = f"group {j.binding_group} ({g.label})" if g else f"group {j.binding_group}"
    if g is not None and j.term_chunk is not None:
        key = j.term_key.hex() if j.term_key else "?"
        chunk = (
            f"chunk {j.term_chunk} (tokens {j.term_chunk * g.tpc:,}-"
            f"{(j.term_chunk + 1) * g.tpc:,}), key {key} ({j.term_result}, {j.term_cause})"
        )
    else:
        chunk = "every needed chunk resident"
    rank = "" if st.dp_rank is None else f", DP rank {st.dp_rank}"
    return (
        f"keytrace: write-only offload: request {j.req_id} on engine {st.engine}{rank} got "
        f"{j.external or 0:,} external tokens, expected E={j.E or 0:,} from S={j.S:,}; {where} "
        f"ended the match at {chunk}; cause {j.cause}. Stores of this key/group are not "
        f"found by lookups. Further mismatches of this group and cause are counted "
        f"(keytrace_episodes_total). Details: {details(st, j.req_id)}"
    )


def describe_stalled(st: InstanceState, j: Judged, tiered: bool) -> str:
    """The warning of a request deferred without end."""
    rank = "" if st.dp_rank is None else f", DP rank {st.dp_rank}"
    expected = "" if j.E is None else f" (expected E={j.E:,} from S={j.S:,})"
    why = (
        "a tiered manager's promotions can evict the request's own prefix (keytrace "
        "docs/findings.md)"
        if tiered
        else "a store or load that never settles keeps it waiting"
    )
    return (
        f"keytrace: stalled lookup: request {j.req_id} on engine {st.engine}{rank} was "
        f"deferred {d.STALL_EPISODES} times in a row, or for {d.STALL_NS / 1e9:.0f} s, "
        f"and served nothing{expected}; {why}. Further stalled requests on this engine "
        f"are summarised in the log. Details: {details(st, j.req_id)}"
    )


def log_repeats(n: int, what: Problem) -> None:
    """One line for ``n`` more of a problem already warned about."""
    engine, group, cause = what
    if cause == "stalled":
        log.warning(
            "keytrace: %d more stalled request(s) on engine %s since the last report", n, engine
        )
        return
    log.warning(
        "keytrace: %d more write-only mismatch(es) on engine %s, group %s (%s) since the "
        "last report",
        n,
        engine,
        group,
        cause,
    )
