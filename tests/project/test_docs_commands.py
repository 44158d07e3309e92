"""Every `vlmq` command the README and docs/ show is one the CLI takes, and the README's
quickstart runs as written.

(a) Each `vlmq ...` command in a fenced shell block of README.md and docs/*.md is parsed by
    the real click CLI: the subcommand chain resolved and each level's `make_context` run
    with resilient parsing off, so an unknown option, a bad value or a missing argument
    fails here, while nothing is executed. Paths the command names are created in a scratch
    folder first (a schema file is a real schema), since some options read their file.
(b) The README's quickstart block runs for real, line by line as bash runs it: a worker
    process on the tiny model, a PDF and a folder of images enqueued, status, wait,
    result and export, against this test's Redis db.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from tests.support.helpers import make_images, make_pdf, pdf_bytes, wait_for

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"sh", "bash", "shell", "console", "zsh"}
# Blocks that are not commands: code, data, and file trees (`text`).
OTHER_LANGS = {"python", "json", "yaml", "text"}
QUICKSTART_HEADING = "## Run it on your own files"
# Words that run the next word as a command.
PREFIX_WORDS = {"env", "exec", "nohup", "time", "sudo", "command"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# What `$(...)` stands for once its command is taken out: long enough for any option that
# wants a token (the dashboard's needs 16+ characters).
SUBSTITUTED = "0123456789abcdef0123456789abcdef"
# A word that is one shell parameter ("$B", "${ID}"): the shell gives vlmq its value.
SHELL_PARAMETER = re.compile(r"\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")
PATH_SUFFIXES = {".pdf", ".png", ".jpg", ".jpeg", ".tif", ".tiff", ".heic", ".json",
                 ".jsonl", ".md", ".csv", ".txt", ".log", ".env", ".yml", ".yaml"}


@dataclass(frozen=True)
class Command:
    where: str          # "docs/jobs.md:12"
    env: dict[str, str]  # VAR=value words before it
    args: list[str]     # what follows `vlmq`

    def __str__(self) -> str:
        return f"{self.where}: vlmq {shlex.join(self.args)}"


# --- reading the docs --------------------------------------------------------------------


def fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(line number of the first line inside, language, lines) of every fenced block."""
    blocks: list[tuple[int, str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not match:
            i += 1
            continue
        fence, lang, start = match.group(2), match.group(3).lower(), i + 1
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append((start + 1, lang, body))
        i += 1
    return blocks


def logical_lines(first: int, body: list[str]) -> list[tuple[int, str]]:
    """Shell lines of a block: continuations joined, heredoc bodies and prompts left out."""
    out: list[tuple[int, str]] = []
    i = 0
    while i < len(body):
        number, line = first + i, body[i]
        while line.endswith("\\") and i + 1 < len(body):
            i += 1
            line = line[:-1] + " " + body[i].strip()
        i += 1
        line = re.sub(r"^\s*\$ ", "", line)
        heredoc = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        if heredoc:  # the heredoc's text is a file's content, not commands
            while i < len(body) and body[i].strip() != heredoc.group(1):
                i += 1
            i += 1
            line = line[:heredoc.start()]
        out.append((number, line))
    return out


def split_substitutions(line: str) -> list[str]:
    """The line with each `$(...)` replaced by SUBSTITUTED, then each inner command."""
    inner: list[str] = []
    pattern = re.compile(r"\$\(([^()]*)\)")
    while True:
        match = pattern.search(line)
        if not match:
            return [line, *inner]
        inner.append(match.group(1))
        line = line[:match.start()] + SUBSTITUTED + line[match.end():]


def simple_commands(line: str) -> list[list[str]]:
    """The words of each simple command of a shell line: operators split them, comments and
    redirections are dropped."""
    line = re.sub(r"(?<![\w$])\d+(?=[<>])", "", line)  # the fd of 2>&1
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    tokens = list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token and all(c in "();<>|&" for c in token):
            if "<" in token or ">" in token:
                i += 2  # a redirection and its target
                continue
            commands.append([])
        else:
            commands[-1].append(token)
        i += 1
    return [c for c in commands if c]


def vlmq_commands_in(text: str, name: str) -> list[Command]:
    found: list[Command] = []
    for first, lang, body in fenced_blocks(text):
        if lang not in SHELL_LANGS:
            continue
        for number, line in logical_lines(first, body):
            for part in split_substitutions(line):
                try:
                    commands = simple_commands(part)
                except ValueError as exc:  # shlex: an unclosed quote
                    raise ValueError(f"{name}:{number}: {exc}: {line}") from None
                for words in commands:
                    env: dict[str, str] = {}
                    while words and (ASSIGNMENT.match(words[0]) or words[0] in PREFIX_WORDS):
                        if ASSIGNMENT.match(words[0]):
                            key, _, value = words[0].partition("=")
                            env[key] = value
                        words = words[1:]
                    if words and (words[0] == "vlmq" or words[0].endswith("/vlmq")):
                        found.append(Command(f"{name}:{number}", env, words[1:]))
    return found


def documented_commands() -> list[Command]:
    return [cmd for path in DOC_FILES
            for cmd in vlmq_commands_in(path.read_text(encoding="utf-8"),
                                        str(path.relative_to(ROOT)))]


# --- checking one command against the CLI ------------------------------------------------


def materialize(arg: str, sandbox: Path) -> str:
    """A path-like word made real under `sandbox` (the cwd while parsing); `~` is the
    sandbox's home. Anything else is returned as it is."""
    prefix, value = "", arg
    if arg.startswith("--") and "=" in arg:
        prefix, value = arg.split("=", 1)
        prefix += "="
    if SHELL_PARAMETER.fullmatch(value):
        return prefix + SUBSTITUTED  # the shell expands it: ids are checked by their shape
    if value.startswith("~/") or value == "~":
        value = str(sandbox / "home") + value[1:]
    elif value.startswith("-"):
        return arg
    path = Path(value)
    if ("://" in value or "=" in value or "*" in value or "$" in value
            or (path.is_absolute() and not path.is_relative_to(sandbox))):
        return prefix + value
    if "/" not in value and path.suffix.lower() not in PATH_SUFFIXES:
        return prefix + value
    target = path if path.is_absolute() else sandbox / path
    if target.exists():
        return prefix + value
    suffix = target.suffix.lower()
    if value.endswith("/") or suffix not in PATH_SUFFIXES:
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        if suffix == ".json":
            target.write_text('{"type": "object"}')
        elif suffix == ".pdf":
            target.write_bytes(pdf_bytes(1))
        elif suffix in {".png", ".jpg", ".jpeg"}:
            make_images(target.parent, 1)[0].rename(target)
        else:
            target.write_text("")
    return prefix + value


def check_parses(args: list[str], sandbox: Path) -> None:
    """Parse `vlmq ARGS` as the CLI would, down to the last subcommand, running nothing.
    Raises click's UsageError (or BadParameter) when the CLI would refuse it."""
    from vlmq.cli.main import main

    args = [materialize(a, sandbox) for a in args]
    command: click.Command = main
    ctx = main.make_context("vlmq", list(args))
    path = []
    while isinstance(command, click.Group):
        # A group keeps its subcommand and the words after it unparsed.
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            break  # a group that runs on its own (vlmq enqueue --manifest FILE)
        name, sub, rest = command.resolve_command(ctx, rest)
        assert name is not None and sub is not None
        path.append(name)
        ctx = sub.make_context(name, rest, parent=ctx)
        command = sub
    if path[:1] == ["service"] and "--" in args:
        # Whatever follows `--` goes to `vlmq worker`: it must parse there too.
        check_parses(["worker", *args[args.index("--") + 1:]], sandbox)


COMMANDS = documented_commands()


def test_every_block_with_a_vlmq_command_is_a_shell_block() -> None:
    """A command in a block tagged otherwise (or not at all) would escape the check."""
    untagged = [f"{path.relative_to(ROOT)}:{first}"
                for path in DOC_FILES
                for first, lang, body in fenced_blocks(path.read_text(encoding="utf-8"))
                if lang not in SHELL_LANGS
                and (lang not in OTHER_LANGS
                     or any(re.match(r"^\s*(\$ )?vlmq ", line) for line in body))]
    assert not untagged, f"tag these blocks sh (or text, for a tree): {untagged}"


def test_the_docs_show_commands_and_the_reader_finds_them() -> None:
    files = {c.where.split(":")[0] for c in COMMANDS}
    assert "README.md" in files and len(files) >= 6, files
    quickstart = [c for c in COMMANDS if c.args[:2] == ["enqueue", "ocr"]
                  and c.where.startswith("README.md:")]
    assert quickstart, "the README shows no `vlmq enqueue ocr`"


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_documented_command_parses(command: Command, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for key, value in command.env.items():
        monkeypatch.setenv(key, value)
    if "_VLMQ_COMPLETE" in command.env:  # shell completion: click prints the shell's script
        from click.testing import CliRunner

        from vlmq.cli.main import main

        res = CliRunner().invoke(main, command.args, prog_name="vlmq")
        assert res.exit_code == 0 and "_VLMQ_COMPLETE" in res.stdout, (str(command), res.output)
        return
    try:
        check_parses(command.args, tmp_path)
    except click.exceptions.Exit:
        pass  # an eager option such as --help: parsed
    except click.ClickException as exc:
        pytest.fail(f"{command}\n  the CLI refuses it: {exc.format_message()}")


@pytest.mark.parametrize("line", [
    "vlmq enqueue ocr report.pdf --no-such-option",
    "vlmq enqueue ocr report.pdf --pages",
    "vlmq worker --queues ocr",
    "vlmq wait",
    "vlmq enqueu ocr report.pdf",
    "vlmq result JOB --format nope",
    "vlmq service print systemd -- --model M --no-such-worker-option",
])
def test_a_wrong_command_fails_the_check(line: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    [command] = vlmq_commands_in(f"```sh\n{line}\n```\n", "sample")
    with pytest.raises(click.ClickException):
        check_parses(command.args, tmp_path)


def test_the_reader_handles_shell_forms() -> None:
    text = "\n".join([
        "```bash",
        "ID=$(vlmq enqueue --openai-batch requests.jsonl)   # a job id",
        "REDIS_URL=redis://h:6379/0 vlmq status \\",
        "    --json",
        "vlmq worker --model ./m > worker.log 2>&1 &",
        "vlmq wait \"$B\" && vlmq export \"$B\" --dir out/",
        "python3 - <<'EOF'",
        "vlmq not-a-command-inside-a-heredoc",
        "EOF",
        "```",
        "```python",
        "vlmq not-shell",
        "```",
    ])
    found = [(c.where, c.env, c.args) for c in vlmq_commands_in(text, "t")]
    assert found == [
        ("t:2", {}, ["enqueue", "--openai-batch", "requests.jsonl"]),
        ("t:3", {"REDIS_URL": "redis://h:6379/0"}, ["status", "--json"]),
        ("t:5", {}, ["worker", "--model", "./m"]),
        ("t:6", {}, ["wait", "$B"]),
        ("t:6", {}, ["export", "$B", "--dir", "out/"]),
    ]


# --- the quickstart, for real ------------------------------------------------------------


def quickstart_lines() -> list[tuple[int, str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert QUICKSTART_HEADING in text, f"README.md has no {QUICKSTART_HEADING!r} section"
    section = text.split(QUICKSTART_HEADING, 1)[1].split("\n## ", 1)[0]
    offset = text[:text.index(QUICKSTART_HEADING)].count("\n")
    shell = [(first, body) for first, lang, body in fenced_blocks(section)
             if lang in SHELL_LANGS]
    assert len(shell) == 1, "the quickstart section should hold exactly one shell block"
    first, body = shell[0]
    return [(offset + n, line) for n, line in logical_lines(first, body)]


def inputs_of(lines: list[tuple[int, str]]) -> list[tuple[str, str]]:
    """(task, input path) of each `vlmq enqueue TASK PATH` in the block."""
    block = "```sh\n" + "\n".join(text for _, text in lines) + "\n```\n"
    return [(cmd.args[1], cmd.args[2]) for cmd in vlmq_commands_in(block, "qs")
            if cmd.args[:1] == ["enqueue"] and len(cmd.args) >= 3]


@pytest.mark.slow
def test_readme_quickstart_runs_end_to_end(redis_url: str, tmp_path: Path,
                                           procs: list[subprocess.Popen[str]]) -> None:
    lines = quickstart_lines()
    checkout = tmp_path / "checkout"  # stands in for the checkout: its .venv is ours
    home = tmp_path / "home"
    checkout.mkdir()
    home.mkdir()
    venv = Path(sys.prefix)
    if not (venv / "bin" / "activate").exists() or not (venv / "bin" / "vlmq").exists():
        pytest.skip(f"the tests do not run from a virtual environment with vlmq ({venv})")
    (checkout / ".venv").symlink_to(venv, target_is_directory=True)

    # The user's own files, where the block names them.
    inputs = inputs_of(lines)
    assert [task for task, _ in inputs] == ["ocr", "caption"], inputs
    made: dict[str, Path] = {}
    for task, name in inputs:
        where = Path(name.replace("~", str(home), 1)) if name.startswith("~") \
            else checkout / name
        if task == "ocr":
            where.parent.mkdir(parents=True, exist_ok=True)
            make_pdf(where, 3)
        else:
            make_images(where, 4)
            # A photo library's sidecars, which are not pictures: left out, said so.
            (where / "notes.txt").write_text("trip notes\n")
            (where / "img0.png.xmp").write_text('<x:xmpmeta xmlns:x="adobe:ns:meta/"/>\n')
            (where / "img1.png.json").write_text('{"title": "img1"}\n')
        made[task] = where

    # The suite's Redis stands in for the line that starts one.
    script = ["set -e -x -o pipefail"]
    redis_lines = [text for _, text in lines if text.strip().startswith("redis-")]
    assert redis_lines, "the quickstart no longer says how to get a Redis"
    script += [": the suite's Redis stands in for: " + shlex.quote(text)
               if text.strip().startswith("redis-") else text for _, text in lines]
    (tmp_path / "quickstart.sh").write_text("\n".join(script) + "\n")

    env = {**os.environ, "HOME": str(home), "REDIS_URL": redis_url,
           "VLMQ_PREFIX": f"qs{uuid.uuid4().hex[:8]}", "VLMQ_CACHE": str(tmp_path / "cache"),
           "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if Path(p) != venv / "bin")  # the block must activate it
    proc = subprocess.Popen(["bash", str(tmp_path / "quickstart.sh")], cwd=checkout, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    procs.append(proc)
    try:
        out, _ = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        raise AssertionError("the quickstart did not end in 420 s") from None
    log = checkout / "worker.log"
    worker_log = log.read_text() if log.exists() else "(no worker.log)"
    assert proc.returncode == 0, f"{out}\n--- worker.log\n{worker_log}"

    # What the block says it leaves: the PDF's pages in report.md, one caption per image.
    report = (checkout / "report.md").read_text(encoding="utf-8")
    assert "finished, 3/3 items" in report, report[:500]
    for page in (1, 2, 3):
        assert f"{made['ocr'].name} — page {page}" in report, report[:500]
    captions = sorted(p.relative_to(checkout / "captions").as_posix()
                      for p in (checkout / "captions").rglob("*.txt"))
    assert captions == [f"img{i}.png.txt" for i in range(4)], captions
    assert all((checkout / "captions" / c).read_text() for c in captions)
    assert out.count(": finished") == 2, out  # vlmq wait: both jobs
    assert "skipped 3 files that are not PDFs or images" in out, out
    assert "no live worker" not in out, out  # the worker started a moment before counts
    # `kill %1` stops the worker the way SIGTERM does: it drains and exits.
    wait_for(lambda: "stopped" in log.read_text(), 90, "the worker to stop after kill %1")
