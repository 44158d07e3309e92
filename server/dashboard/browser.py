"""Headless Chromium, for the dashboard's screenshots and its in-browser tests.

The dashboard's pages run no script, so the browser's console must stay empty: anything
it logs (a blocked resource, a CSP refusal, a broken image) is a fault. Chromium writes
console messages to stderr with --enable-logging=stderr as `...:CONSOLE...] "message"`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--enable-logging=stderr", "--v=0")
CONSOLE_RE = re.compile(r":CONSOLE[:(][^\]]*\]\s*(.*)$")
TIMEOUT_S = 90.0


@dataclass(frozen=True)
class Visit:
    stdout: str
    console: list[str]  # every message the page logged to the console


def find_chromium() -> str | None:
    wanted = os.environ.get("VLMQ_CHROMIUM")
    if wanted:
        return wanted
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def visit(url: str, *args: str, binary: str | None = None,
          timeout_s: float = TIMEOUT_S) -> Visit:
    """Load `url` once in a fresh profile with extra `args` (--dump-dom, --screenshot=...)."""
    chromium = binary or find_chromium()
    if chromium is None:
        raise FileNotFoundError("no Chromium found (apt-get install chromium, or set "
                                "VLMQ_CHROMIUM)")
    with tempfile.TemporaryDirectory(prefix="vlmq-chromium-") as profile:
        cmd = [chromium, *FLAGS, f"--user-data-dir={profile}", *args, url]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              check=False, cwd=profile)
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited {done.returncode}: {done.stderr[-2000:]}")
    console = [m.group(1) for line in done.stderr.splitlines()
               if (m := CONSOLE_RE.search(line))]
    return Visit(stdout=done.stdout, console=console)


def dump_dom(url: str, *, binary: str | None = None,
             timeout_s: float = TIMEOUT_S) -> Visit:
    return visit(url, "--dump-dom", binary=binary, timeout_s=timeout_s)


def screenshot(url: str, out: Path, size: tuple[int, int] = (1400, 1000), *,
               binary: str | None = None, timeout_s: float = TIMEOUT_S) -> Visit:
    out.parent.mkdir(parents=True, exist_ok=True)
    return visit(url, f"--screenshot={out.resolve()}", f"--window-size={size[0]},{size[1]}",
                 binary=binary, timeout_s=timeout_s)
