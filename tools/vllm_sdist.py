"""vLLM's own test tree from its source distribution, ready to run offline on a CPU.

    python tools/vllm_sdist.py [--version 0.33.0] [--cache DIR] [--sources]

Prints the tree's path and the ``HF_HOME`` to use. With ``--sources`` (and always for a
release other than the installed one) the tree also holds the sdist's ``vllm/`` package:
put the tree first on ``PYTHONPATH`` and ``import vllm`` is that release's Python code,
running over the installed vLLM's dependencies (torch, transformers, ...). No compiled
extension comes with it: a CPU scheduler never needs one (vLLM logs "Failed to import
from vllm._C" and carries on). That is how one machine runs 0.31.0's and 0.33.0's suites
on their own code without an environment per release (`release_tree`).

The sdist is found through the package index's JSON simple API (PEP 691: the index pip
itself reads; ``PIP_INDEX_URL`` is honoured), checked against the index's sha256 and
unpacked without building anything: ``pip download`` would prepare an sdist's metadata by
running vLLM's setup.py, which needs a build toolchain this machine has no use for. Only
``tests/`` is unpacked. The suite reads ``facebook/opt-125m``'s ``config.json`` through
the Hugging Face cache, so a local cache holding just that file is written next to it
(`hf_home`); point ``HF_HOME`` at it and set ``HF_HUB_OFFLINE=1``.

Cached under ``--cache`` (default ``~/.cache/keytrace``): a second run costs nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

DEFAULT_VERSION = "0.33.0"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "keytrace"
OFFLOADING_SUITE = "tests/v1/kv_connector/unit/offloading_connector"
CONFCUTDIR = "tests/v1/kv_connector"
TIERING_SUITE = "tests/v1/kv_offload/tiering/test_tiering_offloading.py"
TIERING_CONFCUTDIR = "tests/v1/kv_offload"
SUITES = ((OFFLOADING_SUITE, CONFCUTDIR), (TIERING_SUITE, TIERING_CONFCUTDIR))
"""vLLM's own tests keytrace must leave unchanged: the offloading connector's unit suite
and the tiered manager's (where a candidate fix for tiering lands), each with its conftest
root."""

# facebook/opt-125m's config.json, as published; the suite builds ModelConfigs from it.
OPT_125M_CONFIG = {
    "_name_or_path": "facebook/opt-125m",
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "transformers_version": "4.21.0.dev0",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def find_sdist(version: str) -> tuple[str, str, str]:
    """(file name, URL, sha256) of vLLM ``version``'s sdist on the index."""
    req = urllib.request.Request(
        f"{index_url()}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        files = json.load(resp)["files"]
    name = f"vllm-{version}.tar.gz"
    for f in files:
        if f["filename"] == name:
            return name, f["url"], f["hashes"]["sha256"]
    raise SystemExit(f"vllm_sdist: {name} is not on {index_url()}")


def fetch(version: str, cache: Path) -> Path:
    """The sdist file, downloaded once and checked against the index's sha256."""
    dest = cache / f"vllm-{version}.tar.gz"
    if dest.exists():
        return dest
    _name, url, sha256 = find_sdist(version)
    cache.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with (
        tempfile.NamedTemporaryFile(dir=cache, delete=False) as tmp,
        urllib.request.urlopen(url, timeout=600) as resp,
    ):
        for block in iter(lambda: resp.read(1 << 20), b""):
            digest.update(block)
            tmp.write(block)
    if digest.hexdigest() != sha256:
        os.unlink(tmp.name)
        raise SystemExit(f"vllm_sdist: sha256 mismatch for {url}")
    os.replace(tmp.name, dest)
    return dest


def unpack_tests(sdist: Path, version: str, cache: Path) -> Path:
    """``<cache>/vllm-<version>/`` holding the sdist's ``tests/`` (unpacked once)."""
    return _unpack(sdist, version, cache / f"vllm-{version}", ("tests/",), OFFLOADING_SUITE)


def unpack_sources(sdist: Path, version: str, cache: Path) -> Path:
    """``<cache>/vllm-<version>-src/`` holding the sdist's ``tests/`` and ``vllm/``
    (unpacked once): a tree whose ``vllm`` package is that release's Python code."""
    return _unpack(
        sdist, version, cache / f"vllm-{version}-src", ("tests/", "vllm/"), "vllm/version.py"
    )


def _unpack(sdist: Path, version: str, root: Path, folders: tuple[str, ...], done: str) -> Path:
    """Unpack ``folders`` of the sdist into ``root`` via a staging folder and one rename,
    so an interrupted unpack is never taken for a finished one (``done`` marks it)."""
    if (root / done).exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root.parent))
    prefixes = tuple(f"vllm-{version}/{f}" for f in folders)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefixes)]
        tar.extractall(staging, members=members, filter="data")
    shutil.rmtree(root, ignore_errors=True)
    os.replace(staging / f"vllm-{version}", root)
    shutil.rmtree(staging, ignore_errors=True)
    return root


def installed_version() -> str | None:
    """The installed vLLM's version, from its metadata (vLLM is not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def release_tree(version: str, cache: Path = DEFAULT_CACHE) -> tuple[Path, bool]:
    """(tree, overlay): the tree to run ``version``'s suite in, and whether it carries its
    own ``vllm/`` (True unless ``version`` is the installed release, which runs as
    installed)."""
    sdist = fetch(version, cache)
    if installed_version() == version:
        return unpack_tests(sdist, version, cache), False
    return unpack_sources(sdist, version, cache), True


def hf_home(cache: Path) -> Path:
    """A Hugging Face cache holding only facebook/opt-125m's config.json."""
    home = cache / "hf-home"
    repo = home / "hub" / "models--facebook--opt-125m"
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M_CONFIG, indent=2))
    return home


def prepare(version: str = DEFAULT_VERSION, cache: Path = DEFAULT_CACHE) -> tuple[Path, Path]:
    """(vLLM source tree with tests/, HF_HOME to use): everything the suite needs offline."""
    tree = unpack_tests(fetch(version, cache), version, cache)
    return tree, hf_home(cache)


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--version", default=DEFAULT_VERSION)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--sources", action="store_true", help="Also unpack the sdist's vllm/.")
    args = ap.parse_args()
    if args.sources:
        tree = unpack_sources(fetch(args.version, args.cache), args.version, args.cache)
        home = hf_home(args.cache)
    else:
        tree, home = prepare(args.version, args.cache)
    print(tree)
    print(home)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
