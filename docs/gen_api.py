"""Write docs/api.md, the reference of every public name, from the code's `__all__`s and docstrings.

    python docs/gen_api.py           # rewrite docs/api.md
    python docs/gen_api.py --check   # exit 1, saying what changed, if docs/api.md is out of date

The public modules are ROOTS plus every module named in a public module's `__all__` (so a new
sub-package exported as `manualpar.metrics` is picked up without editing this file). Each name
gets its signature and the first paragraph of its docstring; a class also lists its own public
methods and properties. A constant's line is the `#` comment above (or beside) its assignment.
tests/unit/test_docs_api.py fails while the committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import importlib
import inspect
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOTS = (
    "manualpar",
    "manualpar.embeddings",
    "manualpar.testing",  # run_distributed, in the README's Development section
    "manualpar.cli.torchx_component",  # the torchx component manualpar.run_script
)
PAGE = Path(__file__).resolve().parent / "api.md"
COMMAND = "python docs/gen_api.py"
WIDTH = 100  # longer signatures are written one parameter a line
NO_DOC = "*(no docstring)*"
_SENTENCE = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.\s+(?=[A-Z`(])")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # default values' reprs must not change per run

HEADER = """# API reference

Generated from the public modules' `__all__` and docstrings by `python docs/gen_api.py`; do
not edit it by hand. After adding, renaming or changing a public name, run
`python docs/gen_api.py` and commit this page: `tests/unit/test_docs_api.py` fails while it is
out of date (`python docs/gen_api.py --check` shows the difference). What is public, by rule:
the docstring of `manualpar/__init__.py`; anything deeper than these modules is internal.
"""


def public_modules() -> list[types.ModuleType]:
    """ROOTS, then the modules their `__all__`s export, in order, each once."""
    found: list[types.ModuleType] = []
    queue = [importlib.import_module(name) for name in ROOTS]
    while queue:
        module = queue.pop(0)
        if module in found:
            continue
        found.append(module)
        queue += [v for v in (getattr(module, n) for n in module.__all__) if inspect.ismodule(v)]
    return found


def summary(obj: Any) -> str:
    """The first paragraph of `obj`'s own docstring, on one line ('' if it has none)."""
    doc = obj.__doc__ if isinstance(obj.__doc__, str) else None
    name = getattr(obj, "__name__", "")
    if not doc or (inspect.isclass(obj) and doc.startswith(f"{name}(")):  # a dataclass's default
        return ""
    text = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    if len(text) > 160:  # one line: the first sentence of a long paragraph
        text = _SENTENCE.split(text, maxsplit=1)[0].rstrip(".") + "."
    return text


class _Raw:
    """An annotation written as in the source (no quotes around postponed annotations)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def signature(obj: Callable[..., Any], name: str, wrap: bool = True) -> str:
    """`name(params) -> returns` as in the source; one parameter a line (as ruff format writes
    a long def) when longer than WIDTH and `wrap`."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins have none
        return f"{name}(...)"

    def raw(annotation: Any) -> Any:
        if annotation is inspect.Parameter.empty:
            return annotation
        text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
        return _Raw(text)

    params = [p.replace(annotation=raw(p.annotation)) for p in sig.parameters.values()]
    sig = sig.replace(parameters=params, return_annotation=raw(sig.return_annotation))
    text = _ADDRESS.sub("", f"{name}{sig}")
    if len(text) <= WIDTH or not wrap:
        return text
    lines = []
    for i, param in enumerate(params):
        before = params[i - 1].kind if i else None
        if param.kind is param.KEYWORD_ONLY and before not in (
            param.KEYWORD_ONLY,
            param.VAR_POSITIONAL,
        ):
            lines.append("*,")  # the bare marker str(sig) adds before keyword-only parameters
        lines.append(_ADDRESS.sub("", str(param)) + ",")
        if param.kind is param.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not param.POSITIONAL_ONLY
        ):
            lines.append("/,")
    returns = "" if sig.return_annotation is sig.empty else f" -> {sig.return_annotation!r}"
    return f"{name}(\n" + "".join(f"    {line}\n" for line in lines) + f"){returns}"


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public methods and properties `cls` and its manualpar bases define themselves."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("manualpar"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            if isinstance(value, staticmethod | classmethod):
                value = value.__func__
            if inspect.isfunction(value) or isinstance(value, property):
                seen.add(name)
                yield name, value


@functools.cache
def _parsed(path: Path, mtime_ns: int) -> tuple[list[str], list[ast.stmt]]:
    """A source file's lines and top-level statements, parsed once per version of the file (the
    page looks up each of its constants in the same hundred files)."""
    lines = path.read_text().splitlines()
    return lines, ast.parse("\n".join(lines)).body


def _constant_comment(module: types.ModuleType, name: str) -> str:
    """The comment above or beside `name = ...` in the module that assigns it ('' if none)."""
    for path in sorted(Path(module.__file__ or "").parent.rglob("*.py")):
        lines, body = _parsed(path, path.stat().st_mtime_ns)
        for node in body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
                continue
            line = lines[node.lineno - 1]
            if "#" in line:
                return line.split("#", 1)[1].strip()
            above = []
            for previous in reversed(lines[: node.lineno - 1]):
                if not previous.lstrip().startswith("#"):
                    break
                above.insert(0, previous.lstrip("# ").rstrip())
            return " ".join(above)
    return ""


def _entry(module: types.ModuleType, name: str, obj: Any) -> list[str]:
    lines = [f"### `{module.__name__}.{name}`", ""]
    if inspect.isclass(obj):
        bases = [b.__name__ for b in obj.__bases__ if b is not object]
        head = f"class {name}" + (f"({', '.join(bases)})" if bases else "")
        init = [] if issubclass(obj, BaseException) else [signature(obj, name)]
        lines += ["```python", head, *init, "```", ""]
        text = summary(obj)
    elif callable(obj):
        lines += ["```python", signature(obj, name), "```", ""]
        text = summary(obj)
    else:
        value = _ADDRESS.sub("", repr(obj))
        shown = value if len(value) <= 90 else f"<{type(obj).__name__}>"
        lines += ["```python", f"{name} = {shown}", "```", ""]
        text = _constant_comment(module, name)
    lines.append(text or NO_DOC)
    if inspect.isclass(obj) and not issubclass(obj, BaseException):
        members = []
        for member, value in _members(obj):
            if isinstance(value, property):
                doc = summary(value.fget) if value.fget else ""
                members.append(f"- `.{member}` (property){': ' + doc if doc else ''}")
            else:
                doc = summary(value)
                members.append(
                    f"- `{signature(value, member, wrap=False)}`{': ' + doc if doc else ''}"
                )
        if members:
            lines += ["", *members]
    return [*lines, ""]


def render() -> str:
    """The whole page."""
    out = [*HEADER.splitlines(), ""]
    modules = public_modules()
    out += ["Modules: " + ", ".join(f"[`{m.__name__}`](#{_anchor(m.__name__)})" for m in modules)]
    out.append("")
    documented: dict[int, str] = {}
    for module in modules:
        out += [f"## {module.__name__}", "", summary(module) or NO_DOC, ""]
        for name in module.__all__:
            obj = getattr(module, name)
            where = documented.get(id(obj))
            if inspect.ismodule(obj):
                out += [
                    f"- `{module.__name__}.{name}`: the module [`{obj.__name__}`]"
                    f"(#{_anchor(obj.__name__)}) below.",
                    "",
                ]
            elif where is not None and not isinstance(obj, str | int | float | tuple):
                out += [
                    f"- `{module.__name__}.{name}`: the same object as [`{where}`]"
                    f"(#{_anchor(where)}).",
                    "",
                ]
            else:
                documented.setdefault(id(obj), f"{module.__name__}.{name}")
                out += _entry(module, name, obj)
    return "\n".join(out).rstrip() + "\n"


def _anchor(title: str) -> str:
    """GitHub's anchor for a heading holding `title` in backticks."""
    return re.sub(r"[^a-z0-9_\- ]", "", title.lower()).replace(" ", "-")


def undocumented(page: str) -> list[str]:
    """Names whose entry says it has no docstring or comment."""
    entries = page.split("\n### `")[1:]
    return [e.split("`", 1)[0] for e in entries if NO_DOC in e.split("\n- ", 1)[0]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        old = PAGE.read_text() if PAGE.exists() else ""
        if old == page:
            return 0
        diff = difflib.unified_diff(old.splitlines(), page.splitlines(), "docs/api.md", "code", n=1)
        print("\n".join(list(diff)[:60]), file=sys.stderr)
        print(f"docs/api.md is out of date: run {COMMAND}", file=sys.stderr)
        return 1
    PAGE.write_text(page)
    missing = undocumented(page)
    print(f"wrote {PAGE.name}" + (f"; no docstring: {', '.join(missing)}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
