"""The docs name what the code has: every file, class and `Class.member` they put in backticks exists, every
relative link resolves, and nothing points outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pagedserve"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _classes() -> dict[str, set[str]]:
    """Every class in the package -> the names defined in its body (methods, fields, class attributes)."""
    classes: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                members = classes.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        members.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        members.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        members.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return classes


CLASSES = _classes()
# The .proto's messages and methods are names too (`ModelInfo`, `GenerateResponse`).
PROTO_NAMES = set(re.findall(r"(?:message|rpc)\s+(\w+)", "".join(
    p.read_text() for p in (ROOT / "protos").rglob("*.proto"))))
FILES = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts}


def _code_spans(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_files_classes_and_members_exist(doc):
    missing = []
    for span in _code_spans(doc.read_text()):
        span = span.strip().removesuffix("()")
        path = span.split(":", 1)[0]
        # Paths; a bare name only for source files (`config.json` is a model's file, not ours).
        if (re.fullmatch(r"[\w.-]+/[\w./-]+\.(py|c|md|proto|yaml|json|sh)", path)
                or re.fullmatch(r"[\w.-]+\.(py|c|proto|sh)", path)):
            # A path from the root, or a file under the package (the docs often name `serving/error_status.py`).
            if path not in FILES and not any(f.endswith("/" + path) for f in FILES):
                missing.append(span)
        elif m := re.fullmatch(r"([A-Z][A-Za-z]+)\.([A-Za-z_]\w*)", span):
            cls, member = m.groups()
            if cls in CLASSES and member not in CLASSES[cls]:
                missing.append(span)
        elif re.fullmatch(r"(Step|Sample|Block|Attention|Engine|Request|Async|Worker|Model|Grpc|LLM)\w*", span):
            if span not in CLASSES and span not in PROTO_NAMES:
                missing.append(span)
    assert not missing, f"{doc.name} names what the code does not have: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_stay_inside_the_repository_and_resolve(doc):
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if target.startswith(("http://", "https://")):
            continue
        resolved = (doc.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
        assert resolved.exists(), f"{doc.name} links to a missing file: {target}"
    for target in re.findall(r"(?<![\w/.])((?:\.\./)+[\w./-]+)", text):
        resolved = (doc.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{doc.name} points outside the repository: {target}"
