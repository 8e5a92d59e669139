"""A fixed body of real English text already on every machine: docstrings of Python's standard library.

Deterministic: the same modules in the same order give the same text on any CPython 3.11/3.12.
"""
from __future__ import annotations

import ast
import pathlib
import sysconfig

MODULES = ("argparse", "asyncio/events", "asyncio/tasks", "collections/__init__", "concurrent/futures/_base",
           "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email/message",
           "enum", "fractions", "functools", "heapq", "http/client", "inspect", "ipaddress", "json/__init__",
           "logging/__init__", "mailbox", "pathlib", "pickle", "random", "shutil", "smtplib", "statistics",
           "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest/case",
           "urllib/parse", "uuid", "zipfile")


def stdlib_docstrings() -> str:
    """All module, class and function docstrings of MODULES, separated by blank lines."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    for name in MODULES:
        path = root / f"{name}.py"
        if not path.exists():
            path = root / name / "__init__.py"
        if not path.exists():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    parts.append(doc)
    return "\n\n".join(parts)


if __name__ == "__main__":
    text = stdlib_docstrings()
    print(len(text), "characters")
