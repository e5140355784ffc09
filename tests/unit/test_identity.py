"""The tier-scope and hash-identity rules (`keytrace.judge.identity`), each once, and what
the reader and the token account do with them."""

from __future__ import annotations

from typing import Any

import polars as pl

from keytrace.analysis import lost
from keytrace.format.reader import PER_ENGINE_KEYS, _configuration
from keytrace.judge.definitions import Verdict
from keytrace.judge.identity import (
    HASH_FIELDS,
    Finding,
    Scope,
    config_header,
    differing_field,
    disagreeing,
    hash_identity_of,
    identity_classes,
    identity_findings,
    on_shared_tier,
    scope_of,
    seed_source,
    seed_warnings,
    shares_tier,
)


def _header(
    algo: str = "sha256",
    source: str = "default",
    digest: str | None = "aa",
    tiers: tuple[str, ...] = ("fs:/mnt/kv",),
    lookahead: int = 0,
    canary: str | None = "c1",
) -> dict[str, Any]:
    return {
        "hash_algo": algo,
        "hash_identity": {
            "hash_algo": algo,
            "seed_source": source,
            "none_hash": digest,
            "lookahead_tokens": lookahead,
            "tokens_per_hash": 16,
            "canary": canary,
        },
        "tier_scope": {
            "cpu": {"identity": "/dev/shm/x", "shared": False},
            "secondary": [
                {"index": i, "type": t.split(":")[0], "identity": t} for i, t in enumerate(tiers)
            ],
        },
    }


def test_cpu_is_private_and_every_secondary_tier_shared() -> None:
    assert scope_of("cpu") is Scope.PRIVATE and scope_of(None) is Scope.PRIVATE
    assert scope_of("example") is Scope.PRIVATE  # vLLM's in-memory tier: a dict per manager
    assert {scope_of(t) for t in ("fs", "obj", "p2p", "kvcr")} == {Scope.SHARED}


def test_engines_share_a_tier_only_where_they_name_the_same_place() -> None:
    assert shares_tier(_header(), _header())
    assert not shares_tier(_header(), _header(tiers=("fs:/mnt/other",)))
    assert not shares_tier(_header(tiers=()), _header(tiers=()))  # CPU tiers: never shared
    assert not shares_tier({}, {})  # old headers: nothing known to be shared


def test_the_seed_source_follows_vllm() -> None:
    assert seed_source("sha256", False) == "default"
    assert seed_source("sha256_cbor", False) == "default"
    assert seed_source("xxhash", False) == "random"
    assert seed_source("xxhash_cbor", False) == "random"
    assert seed_source("xxhash", True) == "PYTHONHASHSEED"  # PYTHONHASHSEED wins


def test_the_first_differing_field_names_the_finding() -> None:
    a = hash_identity_of(_header())
    assert differing_field(a, a) is None
    assert differing_field(a, hash_identity_of(_header(algo="sha256_cbor", digest="bb"))) == (
        "hash_algo"
    )
    assert differing_field(a, hash_identity_of(_header(digest="bb", canary="c2"))) == "none_hash"
    assert differing_field(a, hash_identity_of(_header(lookahead=1, canary="c2"))) == (
        "lookahead_tokens"
    )
    assert differing_field(a, hash_identity_of(_header(canary="c2"))) == "canary"
    # unknown on one side (a random seed not yet drawn, an old header): not compared
    assert differing_field(a, hash_identity_of(_header(digest=None, canary=None))) is None
    assert differing_field(a, hash_identity_of({"hash_algo": "sha256"})) is None
    assert HASH_FIELDS[0][0] == "hash_algo"


def test_engines_sharing_a_tier_and_hashing_differently_are_one_finding() -> None:
    headers = {"a": _header(), "b": _header(digest="bb", source="PYTHONHASHSEED", canary="c2")}
    (f,) = identity_findings(headers)
    assert f.finding is Finding.HASH_IDENTITY and f.engines == ("a", "b")
    assert f.field == "none_hash" and f.tier == "fs:/mnt/kv"
    assert "PYTHONHASHSEED" in f.fix and "seed default" in f.values[0]
    assert "hash_identity" in f.text and "a (" in f.text
    assert identity_classes(headers) == [["a"], ["b"]]


def test_no_finding_without_a_shared_tier_or_a_difference() -> None:
    assert identity_findings({"a": _header(), "b": _header()}) == []
    apart = {"a": _header(), "b": _header(digest="bb", tiers=("fs:/elsewhere",))}
    assert identity_findings(apart) == []
    assert identity_classes({"a": _header(), "b": _header()}) == [["a", "b"]]
    # DP ranks with private CPU tiers: nothing shared, whatever they hash
    assert identity_findings({"a": _header(tiers=()), "b": _header(tiers=(), digest="b")}) == []


def test_the_alarm_names_only_a_finding_of_its_own_engine() -> None:
    mine = _header(digest="bb", canary="c2")
    assert disagreeing(mine, [_header()]) is not None
    assert disagreeing(mine, [_header(digest="bb", canary="c2")]) is None
    assert disagreeing(mine, []) is None


def test_doctor_warns_of_a_shared_tier_under_a_random_seed() -> None:
    (w,) = seed_warnings(_header(algo="xxhash", source="random"))
    assert "random NONE_HASH seed" in w and "PYTHONHASHSEED" in w
    assert seed_warnings(_header(algo="xxhash", source="PYTHONHASHSEED")) == []
    assert seed_warnings(_header(algo="xxhash", source="random", tiers=())) == []
    configured = config_header("xxhash", [{"type": "fs", "root_dir": "/mnt/kv"}], False)
    assert seed_warnings(configured) and not seed_warnings(
        config_header("xxhash", [{"type": "fs", "root_dir": "/mnt/kv"}], True)
    )


def test_on_shared_tier_on_values_and_columns() -> None:
    assert on_shared_tier(1, 2) is True and on_shared_tier(2, 2) is False
    assert on_shared_tier(None, 2) is False
    df = pl.DataFrame({"w": [1, 2, None], "t": [2, 2, 2]})
    assert df.select(on_shared_tier(pl.col("w"), pl.col("t"))).to_series().to_list() == [
        True,
        False,
        False,
    ]


def test_the_reader_compares_configurations_without_the_per_engine_keys() -> None:
    import json

    a, b = _header(), _header(algo="xxhash", digest="bb", tiers=("fs:/other",))
    a["groups"] = b["groups"] = [1]
    assert _configuration(json.dumps(a)) == _configuration(json.dumps(b))
    # one engine with lookahead block hashes, one without (vLLM 0.34.0): its own setting
    b.update(num_hash_lookahead_tokens=2, use_lookahead_block_hashes=True)
    b["eagle_proof_margins"] = {"2": 1}
    assert _configuration(json.dumps(a)) == _configuration(json.dumps(b))
    b["groups"] = [2]
    assert _configuration(json.dumps(a)) != _configuration(json.dumps(b))
    assert {"hash_identity", "tier_scope"} <= PER_ENGINE_KEYS


def _account(verdicts: list[str], **extra: list[Any]) -> dict[str, int]:
    judged = pl.DataFrame(
        {
            "inst": [1, 2][: len(verdicts)],
            "s": [10, 20][: len(verdicts)],
            "req_id": ["r", "q"][: len(verdicts)],
            "engine": ["A", "B"][: len(verdicts)],
            "verdict": verdicts,
            "S": [0] * len(verdicts),
            "N": [100] * len(verdicts),
            "X": [0] * len(verdicts),
            "A": [0] * len(verdicts),
            "E": [None] * len(verdicts),
            "cause": [None] * len(verdicts),
            "bind_gid": [None] * len(verdicts),
            "L": [100] * len(verdicts),
            "E_free": [None] * len(verdicts),
            "limit": [None] * len(verdicts),
        },
        schema_overrides={
            "E": pl.Int64,
            "cause": pl.String,
            "bind_gid": pl.Int32,
            "E_free": pl.Int64,
            "limit": pl.String,
        },
    )
    routing = pl.DataFrame(
        {"inst": [1], "s": [10], **extra},
        schema_overrides={k: pl.Int64 for k in extra},
    )
    out = lost.account(judged, routing, None, frozenset({2})).collect()
    return {c: int(out[c].sum()) for c in out.columns if out[c].dtype.is_integer()}


def test_the_token_account_names_shared_routing_and_identity_apart() -> None:
    # engine A (inst 1): 64 on a tier it shares (a finding), up to 96 on a private tier
    t = _account([Verdict.COLD, Verdict.COLD], E_other=[96], E_shared=[64])
    assert t["cold_shared"] == 64 and t["cold_routing"] == 32
    assert t["cold_not_stored"] == 4  # A's rest
    assert t["cold_hash_identity"] == 100  # engine B (inst 2) is in a finding
    t = _account([Verdict.COLD], E_other=[96])
    assert (t["cold_shared"], t["cold_routing"], t["cold_not_stored"]) == (0, 96, 4)
