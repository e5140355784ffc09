"""A geometry's speculative drafter, without vLLM: what it accepts, how the CLI spells it, and
how it travels through plans and trace headers (absent in every header and plan written
before drafters existed: no drafter)."""

from __future__ import annotations

import json

import pytest

from keytrace.analysis.geometry import (
    HYBRID,
    SMALL,
    Drafter,
    Geometry,
    describe,
    geometry_from_header,
    parse_drafter,
    synthetic_header,
)


@pytest.mark.parametrize(
    ("text", "drafter"),
    [
        ("eagle", Drafter("eagle")),
        ("eagle3:2", Drafter("eagle3", 2)),
        ("mtp:2", Drafter("mtp", 2)),
        ("MTP:2:3", Drafter("mtp", 2, 3)),
        ("none", None),
    ],
)
def test_the_cli_spelling(text: str, drafter: Drafter | None) -> None:
    assert parse_drafter(text) == drafter
    if drafter is not None:
        assert parse_drafter(drafter.spec) == drafter


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ngram", "unknown drafter 'ngram'"),
        ("mtp:0", "at least one token"),
        ("mtp:2:0", "at least one module"),
        ("eagle:1:2", "eagle has no MTP modules"),
        ("mtp:x", "use METHOD[:K[:MODULES]]"),
        ("mtp:1:2:3", "use METHOD[:K[:MODULES]]"),
        ("none:1", "unknown drafter 'none'"),
    ],
)
def test_what_a_drafter_refuses(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_drafter(text)


def test_a_plan_without_a_drafter_is_written_and_read_as_before() -> None:
    d = SMALL.to_dict()
    assert "drafter" not in d  # plans and generated tests written before stay byte-identical
    assert Geometry.from_dict(json.loads(json.dumps(d))) == SMALL


def test_a_plan_with_a_drafter_round_trips() -> None:
    geo = HYBRID.with_(drafter=Drafter("mtp", 2, 3))
    d = json.loads(json.dumps(geo.to_dict()))
    assert d["drafter"] == {"method": "mtp", "num_speculative_tokens": 2, "mtp_modules": 3}
    assert Geometry.from_dict(d) == geo
    assert describe(geo).endswith(", drafter mtp:2:3")


@pytest.mark.parametrize(
    "drafter", [None, Drafter("eagle"), Drafter("eagle3", 3), Drafter("mtp", 3, 3)]
)
def test_a_header_round_trips_the_drafter(drafter: Drafter | None) -> None:
    geo = SMALL.with_(drafter=drafter)
    header = synthetic_header(geo, num_hash_lookahead_tokens=1)
    assert header["num_hash_lookahead_tokens"] == 1
    assert geometry_from_header(header).drafter == drafter


def test_the_header_fields_are_the_recorder_s() -> None:
    header = synthetic_header(HYBRID.with_(drafter=Drafter("mtp", 2, 3)))
    assert (header["spec_method"], header["num_speculative_tokens"]) == ("mtp", 2)
    assert header["spec_mtp_modules"] == 3
    eagle = synthetic_header(HYBRID.with_(drafter=Drafter("eagle", 2)))
    assert eagle["spec_mtp_modules"] is None  # only MTP has modules
    plain = synthetic_header(HYBRID)
    assert [plain[k] for k in ("spec_method", "num_speculative_tokens", "spec_mtp_modules")] == [
        None,
        None,
        None,
    ]


def test_older_and_foreign_headers_read_without_a_drafter() -> None:
    header = synthetic_header(SMALL)
    for key in ("spec_method", "num_speculative_tokens", "spec_mtp_modules"):
        del header[key]  # a header written before drafters were recorded
    assert geometry_from_header(header).drafter is None
    # a method the lab does not build (it leaves vLLM's block hashes as they are)
    ngram = {**header, "spec_method": "ngram", "num_speculative_tokens": 3}
    assert geometry_from_header(ngram).drafter is None
    # an MTP drafter recorded before the module count was: vLLM's default, one module
    mtp = {**header, "spec_method": "mtp", "num_speculative_tokens": 2}
    assert geometry_from_header(mtp).drafter == Drafter("mtp", 2, 1)
