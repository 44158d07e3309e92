"""uv.lock: what the set-up commands and CI install, checked against pyproject.toml and
against the venv the suite runs in."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import distributions
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
UV = Path(sys.executable).parent / "uv"
LOCK = tomllib.loads((ROOT / "uv.lock").read_text())
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _project_copy(tmp_path: Path) -> Path:
    """The files the lock check reads, in a folder of their own."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "dev.py", tmp_path / ".ci" / "dev.py")
    for name in ("pyproject.toml", "uv.lock", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def _dev(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, VLMQ_UV=str(UV), VLMQ_VENV=str(root / ".venv"))
    return subprocess.run([sys.executable, str(root / ".ci" / "dev.py"), *args], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300, check=False)


def test_a_dependency_added_without_a_new_lock_stops_the_test_command(tmp_path: Path) -> None:
    root = _project_copy(tmp_path)
    same = _dev(root, "check-lock")
    assert same.returncode == 0, same.stderr
    text = (root / "pyproject.toml").read_text()
    (root / "pyproject.toml").write_text(
        text.replace('    "redis>=5.0.1",\n', '    "redis>=5.0.1",\n    "tomli-w>=1.0",\n', 1))
    assert "tomli-w" in (root / "pyproject.toml").read_text()
    for command in ("test", "demo", "check-lock"):
        done = _dev(root, command)
        assert done.returncode != 0, (command, done.stdout, done.stderr)
        assert "uv.lock does not match pyproject.toml" in done.stderr, done.stderr
        assert "python3 .ci/dev.py lock" in done.stderr, done.stderr
    # Nothing was installed on the way to the refusal.
    assert not (root / ".venv").exists()


def test_the_lock_is_universal_with_hashes() -> None:
    """One lock for macOS arm64 (Metal) and Linux x86_64 and aarch64 (CPU and CUDA)."""
    packages = {p["name"]: p for p in LOCK["package"]}
    for platform in ("macosx_", "manylinux_2_35_x86_64", "manylinux_2_35_aarch64"):
        assert any(platform in w["url"] for w in packages["mlx"]["wheels"]), platform
    for backend, arch in (("mlx-cpu", "x86_64"), ("mlx-cpu", "aarch64"),
                          ("mlx-cuda-12", "x86_64"), ("mlx-cuda-12", "aarch64")):
        assert any(arch in w["url"] for w in packages[backend]["wheels"]), (backend, arch)
    for package in LOCK["package"]:
        if package["name"] == "vlmq":
            continue
        files = [*package.get("wheels", []), *([package["sdist"]] if "sdist" in package else [])]
        assert files, package["name"]
        for f in files:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", f["hash"]), (package["name"], f)
    # worker and cuda each install mlx/lib/libmlx.so: the lock keeps them apart.
    assert [{"extra": "worker"}, {"extra": "cuda"}] in PYPROJECT["tool"]["uv"]["conflicts"]


def test_the_pinned_uv_is_the_one_in_the_lock() -> None:
    pin = re.search(r'"uv==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin is not None
    locked = next(p["version"] for p in LOCK["package"] if p["name"] == "uv")
    assert locked == pin.group(1)


def _locked_versions() -> dict[str, str]:
    """What uv.lock installs here for the set-up commands' extras and group."""
    done = subprocess.run([str(UV), "export", "--frozen", "--no-hashes", "--no-emit-project",
                           "--no-header", "--no-annotate", "--extra", "worker", "--extra",
                           "dashboard", "--group", "dev"], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    out: dict[str, str] = {}
    for line in done.stdout.splitlines():
        if not line.strip() or line.startswith(("#", "-")):
            continue
        spec, _, marker = line.partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate():
            continue
        name, _, version = spec.strip().partition("==")
        out[canonicalize_name(re.sub(r"\[.*\]", "", name))] = version.strip()
    return out


@pytest.mark.skipif(os.environ.get("VLMQ_TEST_VENV", "lock") != "lock",
                    reason="this venv holds the newest releases or the floors, not the lock")
def test_the_venv_holds_exactly_the_lock() -> None:
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}
    installed.pop("vlmq")
    assert installed == _locked_versions()
