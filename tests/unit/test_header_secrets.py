"""A trace header never carries a tier's credentials.

Traces are attached to upstream bug reports. vLLM's object tier takes ``access_key``,
``secret_key`` and ``session_token`` in its ``secondary_tiers`` settings; the header
records each tier's settings (and, for the tier scope, where it keeps its keys), so it
redacts every credential and every URL's password, the same way in every process.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from keytrace.vllm.hook.header import REDACTED, is_secret_name, redacted, secondary_tiers

OBJ = {
    "type": "obj",
    "store_config": {
        "bucket": "kv",
        "endpoint_override": "http://admin:hunter2@minio:9000",
        "access_key": "AKIAEXAMPLE",
        "secret_key": "wJalrXUtnFEMI",
        "session_token": "",
        "region": "us-east-1",
    },
    "max_tokens_per_file": 4096,
}


def test_credentials_are_redacted_and_nothing_else() -> None:
    out = redacted(OBJ)
    store = out["store_config"]
    assert store["access_key"] == store["secret_key"] == REDACTED
    assert store["session_token"] == ""  # empty says: the SDK's default chain
    assert store["endpoint_override"] == f"http://admin:{REDACTED}@minio:9000"
    assert store["bucket"] == "kv" and store["region"] == "us-east-1"
    assert out["max_tokens_per_file"] == 4096  # "tokens" is no credential
    assert "hunter2" not in json.dumps(out) and "wJalr" not in json.dumps(out)
    assert redacted(OBJ) == out  # the same bytes in every process of a configuration


def test_secret_names_are_whole_words() -> None:
    for name in ("secret_key", "session_token", "access_key", "api-key", "password", "Auth"):
        assert is_secret_name(name), name
    for name in ("max_tokens", "tokens_per_file", "key_prefix", "author", "bucket"):
        assert not is_secret_name(name), name


def test_the_header_of_an_object_tier_has_no_secret() -> None:
    tier = SimpleNamespace(tier_type="obj", medium=None, locality=None)
    manager = SimpleNamespace(secondary_tiers=[tier])
    spec = SimpleNamespace(secondary_tier_configs=[OBJ])
    text = json.dumps(secondary_tiers(manager, spec))
    assert "AKIAEXAMPLE" not in text and "hunter2" not in text and REDACTED in text


def test_an_object_tiers_place_names_no_password() -> None:
    from keytrace.vllm.hook.header import _tier_place

    place = _tier_place("obj", SimpleNamespace(), OBJ)
    assert place is not None and "minio:9000/kv" in place and "hunter2" not in place
    other = _tier_place("plugin", SimpleNamespace(), {"api_key": "k", "root": "/x"})
    assert other is not None and '"k"' not in other and "/x" in other


def test_what_a_first_redaction_missed() -> None:
    """A nested credentials block, an Authorization header, camelCase names, a signed
    URL's query, an IPv6 host: what a review found leaking through the first version."""
    out = redacted(
        {
            "credentials": {"user": "u", "pass": "p"},
            "headers": {"Authorization": "Bearer abc"},
            "secretAccessKey": "s",
            "sessionToken": "t",
            "endpoint": "https://acct.blob/c?sv=2024&sig=abcdef",
            "ipv6": "http://admin:pw@[::1]:9000/kv",
        }
    )
    text = json.dumps(out)
    for secret in ('"p"', "Bearer", '"s"', '"t"', "abcdef", ":pw@"):
        assert secret not in text, secret
    assert out["credentials"] == REDACTED
    assert out["ipv6"] == f"http://admin:{REDACTED}@[::1]:9000/kv"
    assert out["endpoint"].startswith("https://acct.blob/c?sv=")
    for name in ("secretAccessKey", "sessionToken", "Authorization", "sig"):
        assert is_secret_name(name), name
    for name in ("passthrough", "author", "signed_urls_enabled"):
        assert not is_secret_name(name), name
