"""The core never imports vLLM or torch; the plugin import path is featherweight.

Each check runs in a fresh interpreter with an import blocker for the forbidden packages,
so an accidental import fails loudly instead of silently succeeding on a dev machine.
"""

from __future__ import annotations

from pathlib import Path

from tests.isolation import run_blocked as _run


def test_core_and_cli_work_without_vllm_or_torch(tmp_path: Path) -> None:
    from tests.factories import new_builder

    b = new_builder(tmp_path / "t")
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5], 2: [4, 5]})
    b.close()
    r = _run(
        "vllm,torch",
        """
        import keytrace, keytrace.format.schema, keytrace.format.writer, keytrace.format.reader, keytrace.analysis.diff
        import keytrace.analysis.summary, keytrace.report.text, keytrace.format.compact, keytrace.cli
        from keytrace.cli import main
        assert main(["diff", "--help"]) == 0
        code = main(["diff", sys.argv[2]])
        assert code == 0, code
        assert main(["summary", sys.argv[2]]) == 0
        assert not loaded("vllm") and not loaded("torch")
        print("OK")
        """,
        str(tmp_path / "t"),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("OK")


def test_blocker_really_blocks() -> None:
    # the proof above is only worth something if the blocker bites
    r = _run("sqlite3", "import sqlite3\n")
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr


def test_plugin_import_path_is_light() -> None:
    r = _run(
        "vllm,torch,polars,click",
        """
        import os
        os.environ.pop("KEYTRACE_DIR", None)
        import keytrace.vllm.hook.plugin
        keytrace.vllm.hook.plugin.register()   # inert without KEYTRACE_DIR
        for m in ("vllm", "torch", "polars", "click"):
            assert not loaded(m), m
        print("OK")
        """,
    )
    assert r.returncode == 0, r.stderr


def test_record_path_does_not_import_polars() -> None:
    r = _run(
        "polars,vllm,torch",
        """
        import keytrace.record.recorder, keytrace.format.writer
        assert not loaded("polars")
        print("OK")
        """,
    )
    assert r.returncode == 0, r.stderr


def test_demo_without_vllm_is_a_clear_error() -> None:
    r = _run(
        "vllm,torch",
        """
        from keytrace.cli import main
        code = main(["demo", "--out", sys.argv[2] + "-" + str(__import__("os").getpid())])
        sys.exit(code)
        """,
        "/tmp/keytrace-no-vllm-demo",
    )
    assert r.returncode == 2
    assert "pip install 'keytrace[vllm]'" in r.stderr and "Traceback" not in r.stderr
