"""`vlmq help [TOPIC]`: the documentation as installed, so that help text can send a user to a
page they have whether vlmq came from a checkout or from a wheel (docs/ ships inside the
wheel as the vlmq.docs package data; the wire protocol ships beside its Lua)."""

from __future__ import annotations

import sys
from importlib.resources import files
from importlib.resources.abc import Traversable

import click

from vlmq.cli.common import EXIT_BAD_INPUT, fail

PROTOCOL = "PROTOCOL"  # shared/PROTOCOL.md, the wire protocol for other languages


def topics() -> dict[str, Traversable]:
    """Each page by the name `vlmq help NAME` takes: a docs page's file stem, and PROTOCOL."""
    pages = {p.name.removesuffix(".md"): p for p in files("vlmq.docs").iterdir()
             if p.name.endswith(".md")}
    pages[PROTOCOL] = files("vlmq.shared") / "PROTOCOL.md"
    return dict(sorted(pages.items()))


def title(page: Traversable) -> str:
    """The page's first heading, which says what it is about."""
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return ""


@click.command("help")
@click.argument("topic", required=False)
@click.pass_context
def help_cmd(ctx: click.Context, topic: str | None) -> None:
    """Print an installed documentation page (no TOPIC: list them); a command's name prints
    that command's --help."""
    pages = topics()
    if topic is None:
        width = max(map(len, pages))
        click.echo("Documentation pages (vlmq help TOPIC prints one):\n")
        for name, page in pages.items():
            click.echo(f"  {name:<{width}}  {title(page)}")
        click.echo("\nvlmq COMMAND --help (or vlmq help COMMAND) describes a command.")
        return
    if topic in pages:
        text = pages[topic].read_text(encoding="utf-8")
        if sys.stdout.isatty():
            click.echo_via_pager(text)
        else:  # the page as it is, for a redirect or a pipe
            click.echo(text, nl=False)
        return
    root = ctx.find_root()
    command = root.command.get_command(root, topic) if isinstance(root.command, click.Group) \
        else None
    if command is not None:
        with click.Context(command, info_name=topic, parent=root) as sub:
            click.echo(command.get_help(sub))
        return
    fail(f"error: no help topic {topic!r}: topics are {', '.join(pages)}; "
         "or a command's name", EXIT_BAD_INPUT)


def register(group: click.Group) -> None:
    group.add_command(help_cmd)
