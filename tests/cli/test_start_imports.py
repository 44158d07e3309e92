"""The CLI starts with only what a command uses (`vlmq --help` took 0.37 s): counted
by the modules a fresh process imports, never by timing. Help, --version and the listing
commands' help import no redis, RQ, Pillow, PDFium, boto3, numpy or MLX; a listing run
against Redis imports no Pillow, PDFium, boto3, numpy, MLX or schema checker."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

from vlmq.cli.main import COMMANDS, main, short_help

HEAVY = ("PIL", "pypdfium2", "boto3", "botocore", "numpy", "mlx", "mlx_vlm", "transformers",
         "rq", "redis", "jsonschema", "llguidance", "prometheus_client", "croniter")
# A listing reads Redis through redis-py and RQ's job hashes, and nothing it never opens:
# media/opener.py imports Pillow and PDFium where a file is opened.
LISTING_NEVER = ("PIL", "pypdfium2", "boto3", "botocore", "numpy", "mlx", "mlx_vlm",
                 "transformers", "jsonschema", "llguidance")
# Nor the client's enqueue side: file checks and stores (producer/client.py, job_sets.py and
# upload.py import them in the functions that enqueue, or for type checks only).
ENQUEUE_SIDE = ("vlmq.producer.inputs", "vlmq.producer.files",
                "vlmq.producer.stream_sets", "vlmq.stores.backends",
                "vlmq.media.opener")

PROBE = """
import json, sys
from vlmq.cli.main import main
try:
    main(sys.argv[1:], prog_name="vlmq")
except SystemExit:
    pass
finally:
    print(json.dumps(sorted({m.split(".")[0] for m in sys.modules}
                            | {m for m in sys.modules if m.startswith("vlmq.")})),
          file=sys.stderr)
"""


def imported(*args: str) -> set[str]:
    """The top-level packages (and vlmq modules) a fresh `vlmq ARGS` process imported."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True,
                          text=True, timeout=300, check=False)
    return set(json.loads(proc.stderr.strip().splitlines()[-1]))


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("jobs", "--help"),
                                  ("status", "--help"), ("wait", "--help"),
                                  ("result", "--help"), ("export", "--help"),
                                  ("cancel", "--help")])
def test_help_and_version_import_nothing_heavy(args: tuple[str, ...]) -> None:
    mods = imported(*args)
    assert not mods & set(HEAVY), sorted(mods & set(HEAVY))
    assert "vlmq.producer.client" not in mods


def test_the_root_help_imports_no_command_module() -> None:
    mods = imported("--help")
    assert not {m for m in mods if m.startswith("vlmq.cli.") and m not in
                ("vlmq.cli.main", "vlmq.cli.common", "vlmq.cli.config")}, sorted(mods)


# `vlmq status` shows the fleet's queue rows, read by producer/fleet.py, which the metrics
# exporter (server/) shares: no listing loads the exporter's Prometheus client.
@pytest.mark.parametrize(("args", "also"), [(("jobs",), ("prometheus_client",)),
                                            (("jobs", "--json"), ("prometheus_client",)),
                                            (("result", "0" * 32), ("prometheus_client",)),
                                            (("status",), ("prometheus_client",))])
def test_a_listing_imports_only_what_it_reads_with(redis_url: str, args: tuple[str, ...],
                                                   also: tuple[str, ...]) -> None:
    mods = imported("--redis-url", redis_url, *args)
    assert "redis" in mods  # it did run
    never = {*LISTING_NEVER, *also}
    assert not mods & never, sorted(mods & never)
    assert not {m for m in mods if m.startswith(("vlmq.worker", "vlmq.server",
                                                 "vlmq.cli.worker", "vlmq.cli.metrics",
                                                 "vlmq.cli.dashboard"))}
    assert not mods & set(ENQUEUE_SIDE), sorted(mods & set(ENQUEUE_SIDE))


def test_each_line_of_the_root_help_is_the_commands_own() -> None:
    ctx = click.Context(main)
    for name, (module, _line) in COMMANDS.items():
        command = main.get_command(ctx, name)
        assert command is not None, f"{name} is not registered by {module}"
        for limit in (45, 80, 10_000):
            assert short_help(main, ctx, name, limit) == command.get_short_help_str(limit), (
                f"cli/main.py COMMANDS[{name!r}] differs from the command's own help")
    # Every command the modules register is listed (loading them all added none).
    assert set(main.commands) <= set(COMMANDS) | {"demo"}
