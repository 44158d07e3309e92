"""`vlmq model check --json`: the report as one JSON object, errors as JSON on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VLMQ = Path(sys.executable).with_name("vlmq")


def check(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return subprocess.run([str(VLMQ), "model", "check", *args], capture_output=True,
                          text=True, timeout=600, env=env)


def test_the_report_is_one_json_object(tiny_model: Path, tmp_path: Path) -> None:
    proc = check(str(tiny_model), "--json", "--max-tokens", "4", "--max-batch", "2",
                 home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["model"], report["model_type"], report["parity"]) == (
        str(tiny_model), "qwen2_vl", True)
    assert report["mismatches"] == [] and report["vision_cache"]["cacheable"] is True
    assert set(report["tok_s"]) == {"sequential", "batch_1", "batch_2"}
    assert "qwen2_vl" in report["preset"]


def test_errors_under_json_are_json_on_stderr(tmp_path: Path) -> None:
    missing = check(str(tmp_path / "nope"), "--json", home=tmp_path)
    assert (missing.returncode, missing.stdout) == (78, "")
    error = json.loads(missing.stderr.strip().splitlines()[-1])["error"]
    assert (error["code"], error["kind"]) == (78, "config")
    assert "does not exist" in error["message"]
    usage = check(str(tmp_path / "nope"), "--json", "--max-batch", "1", home=tmp_path)
    assert usage.returncode == 2
    assert json.loads(usage.stderr.strip().splitlines()[-1])["error"]["kind"] == "usage"
    plain = check(str(tmp_path / "nope"), home=tmp_path)
    assert plain.returncode == 78 and "does not exist" in plain.stderr
    assert not plain.stderr.lstrip().startswith("{")
