"""Offline, licence-clean text that the drafter's prompts are made from: :class:`Passage` (source, topic, text).

    pydoc     the language reference topics that ``help()`` shows, shipped with CPython (``pydoc_data.topics``;
              PSF-2.0); topic: the reference topic
    stdlib    every function and class of 200-700 characters of the installed standard library's source, and its
              docstrings of that size, parsed with ``ast`` (PSF-2.0); topic: the module
    packages  docstrings of 200-700 characters of the installed third-party packages whose metadata declares a
              permissive licence only (``PERMISSIVE``: MIT, BSD, Apache-2.0, PSF, ISC, ...; anything else, or no
              licence, is skipped); topic: the module, licence: the package's declaration

The topic is the unit that a held-out split keeps whole. Nothing is downloaded.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import re
import sysconfig

MIN_CHARS, MAX_CHARS = 200, 700
# SPDX identifiers and trove classifiers of licences whose text may be used freely, attribution aside
PERMISSIVE = {"MIT", "MIT-CMU", "BSD-2-Clause", "BSD-3-Clause", "0BSD", "Apache-2.0", "PSF-2.0", "ISC", "Zlib",
              "Python-2.0", "Unlicense"}
PERMISSIVE_CLASSIFIERS = {"MIT License", "BSD License", "Apache Software License", "Python Software Foundation License",
                          "ISC License (ISCL)", "The Unlicense (Unlicense)", "zlib/libpng License"}
SKIP_DIRS = {"test", "tests", "testing", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__",
             "turtledemo", "_vendor", "vendor", "third_party", "examples"}
PACKAGE_FILES, PACKAGE_PASSAGES = 40, 150  # per distribution: files parsed, passages kept


@dataclasses.dataclass(frozen=True)
class Passage:
    source: str
    topic: str
    text: str
    licence: str


def pydoc_passages() -> list[Passage]:
    """Paragraphs of the language reference topics, joined up to 200-700 characters."""
    import pydoc_data.topics as topics

    out = []
    for name in sorted(topics.topics):
        buf = ""
        for p in (p.strip() for p in topics.topics[name].split("\n\n")):
            if not p or p.startswith(("*", "   ")) and len(p) < 40:
                continue
            buf = f"{buf}\n\n{p}" if buf else p
            if len(buf) >= MIN_CHARS:
                out.append(Passage("pydoc", name, buf[:MAX_CHARS], "PSF-2.0"))
                buf = ""
    return out


def stdlib_passages() -> list[Passage]:
    """Functions, classes and docstrings of the standard library (tests, idlelib, lib2to3, turtledemo skipped)."""
    root = sysconfig.get_paths()["stdlib"]
    return [Passage("stdlib", m, t, "PSF-2.0") for m, t in _parsed(root, None, code=True)]


def packages_passages() -> list[Passage]:
    """Docstrings of the installed distributions with a permissive licence (at most PACKAGE_PASSAGES each, from
    their first PACKAGE_FILES files)."""
    import importlib.metadata as md

    out, seen = [], set()
    for dist in sorted(md.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = dist.metadata["Name"] or ""
        licence = permissive_licence(dist.metadata)
        if licence is None or name.lower() in seen or name == "ddtree_jax":
            continue
        seen.add(name.lower())
        files = sorted(str(f) for f in (dist.files or []) if str(f).endswith(".py"))
        files = [f for f in files if not SKIP_DIRS & set(f.split("/")[:-1])][:PACKAGE_FILES]
        root = str(dist.locate_file(""))
        found = _parsed(root, tuple(files), code=False)[:PACKAGE_PASSAGES]
        out += [Passage("packages", m, t, licence) for m, t in found]
    return out


def permissive_licence(meta) -> str | None:
    """The distribution's licence if every licence it declares is permissive (SPDX ``License-Expression``, else the
    ``License ::`` classifiers, else a short ``License`` field), else None."""
    expr = (meta.get("License-Expression") or "").strip()
    if not expr:
        short = (meta.get("License") or "").strip()
        expr = short if short and "\n" not in short and len(short) < 40 else ""
    if expr:
        alternatives = [a.strip(" ()") for a in re.split(r"\s+OR\s+", expr)]
        ok = [a for a in alternatives if all(i.strip(" ()") in PERMISSIVE for i in re.split(r"\s+AND\s+", a))]
        return ok[0] if ok else None
    cls = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if cls and all(c in PERMISSIVE_CLASSIFIERS for c in cls):
        return " OR ".join(cls)
    return None


_LINE = re.compile(r"(.*?(?:\r\n|\n|\r|$))")  # a line and its end, as the parser counts lines (ast's own pattern)


def _source_segment(lines: list[str], node) -> str:
    """``ast.get_source_segment`` from lines split once per file (the stdlib's splits the source for every node)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset: node.end_col_offset].decode()
    return "".join([lines[first].encode()[node.col_offset:].decode(), *lines[first + 1: last],
                    lines[last].encode()[: node.end_col_offset].decode()])


@functools.lru_cache(maxsize=None)
def _parsed(root: str, files: tuple[str, ...] | None, code: bool) -> list[tuple[str, str]]:
    """(module, text) of the docstrings (and with ``code`` the functions and classes) of 200-700 characters in
    ``files`` under ``root`` (None: every .py file below it, SKIP_DIRS and dot-directories left out)."""
    if files is None:
        files = []
        for dirpath, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
            files += [os.path.relpath(os.path.join(dirpath, n), root) for n in sorted(names) if n.endswith(".py")]
    out = []
    for rel in files:
        module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                source = f.read()
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = _LINE.findall(source)
        for node in ast.walk(tree):
            if code and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                seg = _source_segment(lines, node)
                if MIN_CHARS <= len(seg) <= MAX_CHARS:
                    out.append((module, seg))
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node) or ""
                if len(doc) >= MIN_CHARS:
                    out.append((module, doc[:MAX_CHARS]))
    return sorted(set(out))


CORPORA = {"pydoc": pydoc_passages, "stdlib": stdlib_passages, "packages": packages_passages}


def passages(names: tuple[str, ...]) -> list[Passage]:
    return [p for n in names for p in CORPORA[n]()]
