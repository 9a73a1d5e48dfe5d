"""README.md and docs/ as written: their size, that every command they show exists with the flags they give it, and
that every relative link resolves."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")


def shell_lines(text: str) -> list[str]:
    """The commands of a page's shell code blocks: continuation lines joined, comments dropped."""
    lines = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def python_commands(text: str) -> list[list[str]]:
    """Every `python ... -m MODULE ARGS` the page shows, in its shell blocks and its inline code, as the argument list
    from MODULE on (environment assignments and the interpreter's path dropped; `&&` and `|` split commands)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    candidates = shell_lines(text) + [" ".join(span.split()) for span in INLINE.findall(prose)]
    commands = []
    for candidate in candidates:
        for part in re.split(r"&&|\|\||;|\|(?![^()]*\))", candidate):
            try:
                words = shlex.split(part)
            except ValueError:
                continue
            words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]
            if len(words) >= 3 and re.search(r"(^|/)python[\d.]*$", words[0]) and words[1] == "-m":
                commands.append(words[2:])
    return commands


def help_text(argv: tuple[str, ...]) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", *argv, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_the_readme_is_at_most_30000_bytes():
    assert len(README.read_bytes()) <= 30_000


def test_the_readmes_quick_start_is_what_ci_runs():
    """.ci/run installs and tests with exactly the README's commands (a fresh clone runs what a newcomer reads)."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith(("python3.12 -m venv", ".venv/bin/python -m pytest"))]
    assert len(ci) == 2, ci
    quick = shell_lines(README.read_text())
    for command in ci:
        assert command in quick, command
    assert ".venv/bin/python -m ddtree_jax.generate" in quick  # the default run


def test_every_python_command_shown_exists_with_its_flags():
    """Each `python -m` command of README.md and docs/*.md is run with --help (exit 0), and every flag it names is in
    that help: a renamed module, subcommand or flag fails here."""
    commands = [c for page in PAGES for c in python_commands(page.read_text())]
    assert len(commands) >= 20 and any(c[:2] == ["ddtree_jax.bench", "models"] for c in commands)
    targets = {}
    for words in commands:
        module, rest = words[0], words[1:]
        sub = rest[0] if rest and re.fullmatch(r"[a-z][a-z_]*", rest[0]) else None
        flags = {w.split("=")[0] for w in rest if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", w)}
        key = (module, sub) if module == "ddtree_jax.bench" else (module,)
        targets.setdefault(key, set()).update(flags)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        helps = dict(zip(targets, pool.map(help_text, targets)))
    problems = []
    for key, (code, text) in helps.items():
        if code != 0:
            problems.append(f"python -m {' '.join(key)} --help exits {code}: {text[-300:]}")
            continue
        missing = sorted(f for f in targets[key] if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text))
        if missing:
            problems.append(f"python -m {' '.join(key)}: {missing} not in its --help")
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    """Every relative link of the page points at a file of the repository, and an anchor at one of its headings."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", file.read_text(), flags=re.S), re.M)
            if anchor not in {slug(h) for h in headings}:
                bad.append(target)
    assert not bad, bad


def test_every_record_is_listed_in_the_benchmarks_readme():
    """benchmarks/README.md says what each file of benchmarks/results/ holds: none is left unexplained."""
    listed = (ROOT / "benchmarks" / "README.md").read_text()
    records = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    assert records and [r for r in records if f"`{r}`" not in listed] == []
