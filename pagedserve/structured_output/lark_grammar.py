"""Grammars in Lark's syntax, as vLLM accepts them beside xgrammar's EBNF: recognised, then converted to
EBNF that matches the same texts.

Each rule and terminal becomes an EBNF rule of the same name; the start is `start` (else the first rule, as
vLLM takes it). Terminals are expanded where they are used, so the texts matched are those of the grammar
read as context-free, each terminal matching any string its pattern fully matches (Lark's Earley parser with
`lexer="dynamic_complete"`): where a standard lexer would cut the same text into other tokens (a terminal
taking the longest match) Lark may refuse a text that this grammar accepts.

`%ignore X` lets any number of X come between any two tokens of a rule, and before the first and after the
last, as Lark's lexer skips them there: each terminal, string or regex used in a rule is followed by the
ignored ones. `%import common.X` brings Lark's common terminals (`COMMON`), written here as EBNF with the
meaning Lark's lexer gives them. What cannot be converted is refused, naming the line and the construct:
templates, `%declare` / `%override` / `%extend`, imports from elsewhere, and the regex constructs
`pagedserve.structured_output.lark_regex` names.
"""

from __future__ import annotations

import re

from pagedserve.structured_output.lark_regex import (
    ALT,
    ATOM,
    SEQ,
    Expr,
    RegexError,
    char_class,
    paren,
    quote,
    regex_to_ebnf,
)
from pagedserve.structured_output.lark_regex import repeat as repeat_expr
from pagedserve.structured_output.lark_syntax import (
    Alt,
    Grammar,
    LarkSyntaxError,
    Lit,
    Node,
    Range,
    Ref,
    Regex,
    Repeat,
    Seq,
    is_terminal,
    parse,
)

_SIGN = r"[+\-]?"
_INT = "[0-9]+"
_DECIMAL = f'({_INT} "." [0-9]* | "." {_INT})'
_EXP = f"[eE] {_SIGN} {_INT}"
_FLOAT = f"({_INT} {_EXP} | {_DECIMAL} ({_EXP})?)"

# Lark's common.lark terminals, each as the texts Lark's lexer takes for it. ESCAPED_STRING's lazy regex with
# a lookbehind ends at the first quote not escaped by a backslash; C_COMMENT's at the first "*/".
COMMON = {
    "DIGIT": "[0-9]", "HEXDIGIT": "[0-9A-Fa-f]", "INT": _INT, "SIGNED_INT": f"{_SIGN} {_INT}",
    "DECIMAL": _DECIMAL, "_EXP": _EXP, "FLOAT": _FLOAT, "SIGNED_FLOAT": f"{_SIGN} {_FLOAT}",
    "NUMBER": f"({_FLOAT} | {_INT})", "SIGNED_NUMBER": f"{_SIGN} ({_FLOAT} | {_INT})",
    "ESCAPED_STRING": r'"\"" ([^"\\\n] | "\\" [^\n])* "\""',
    "LCASE_LETTER": "[a-z]", "UCASE_LETTER": "[A-Z]", "LETTER": "[A-Za-z]", "WORD": "[A-Za-z]+",
    "CNAME": "[_A-Za-z] [_A-Za-z0-9]*",
    "WS_INLINE": r"[ \t]+", "WS": r"[ \t\f\r\n]+", "CR": r'"\r"', "LF": r'"\n"', "NEWLINE": r'("\r"? "\n")+',
    "SH_COMMENT": r'"#" [^\n]*', "CPP_COMMENT": r'"//" [^\n]*', "SQL_COMMENT": r'"--" [^\n]*',
    "C_COMMENT": r'"/*" [^*]* "*"+ ([^*/] [^*]* "*"+)* "/"',
}

_GAP = "lark-ignored"  # EBNF names with '-' cannot be Lark names: no clash with the grammar's own
_LARK_LINE = re.compile(r"\s*(%(import|ignore|declare|override|extend)\b"  # a statement, or a definition:
                        r"|[?!]*_?[A-Za-z]\w*\s*(\{[^}]*\}\s*)?(\.\s*[+-]?\d+\s*)?:(?!:=))")  # name{params}.N:


def looks_like_lark(grammar: str) -> bool:
    """Whether a grammar is in Lark's syntax: its first line that is not blank or a comment defines a rule
    with `name:` (EBNF's is `name ::=`) or is a `%` statement."""
    for line in grammar.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", "//")):
            return _LARK_LINE.match(line) is not None
    return False


def lark_to_ebnf(grammar: str) -> str:
    """xgrammar EBNF matching what the Lark grammar matches; LarkSyntaxError (a ValueError) naming the line and
    the construct when it cannot be converted."""
    parsed = parse(grammar)
    _check_imports(parsed)
    _check_references(parsed)
    start = _start(parsed)
    gap = bool(parsed.ignored)
    lines = [f"root ::= {_GAP} {_name(start)}" if gap else f"root ::= {_name(start)}"]
    for name, body in parsed.definitions.items():
        in_rule = gap and not is_terminal(name)
        lines.append(f"{_name(name)} ::= {_emit(body, in_rule, parsed, name)[0]}")
    for alias, (name, _) in parsed.imports.items():
        lines.append(f"{_name(alias)} ::= {COMMON[name]}")
    if gap:
        ignored = " | ".join(_emit(node, False, parsed, "%ignore")[0] for node in parsed.ignored)
        lines.append(f"{_GAP} ::= ({ignored})*")
    return "\n".join(lines) + "\n"


def _name(name: str) -> str:
    return "lark-root" if name == "root" else name  # xgrammar's start is `root`


def _start(grammar: Grammar) -> str:
    if "start" in grammar.definitions:
        return "start"
    rules = [name for name in grammar.definitions if not is_terminal(name)]
    if not rules:
        raise LarkSyntaxError(1, "defines no rule to start from (a lowercase rule, `start` by convention)")
    return rules[0]


def _check_imports(grammar: Grammar) -> None:
    for name, line in grammar.imports.values():
        if name not in COMMON:
            raise LarkSyntaxError(line, f"%import common.{name} is not supported; the common terminals that are: "
                                        f"{', '.join(COMMON)}")


def _check_references(grammar: Grammar) -> None:
    """Every name used is defined, and terminals (and %ignore) use no rules, as Lark requires."""
    def walk(node: Node, owner: str, terminal: bool) -> None:
        if isinstance(node, Ref):
            if node.name not in grammar.lines:
                raise LarkSyntaxError(node.line, f"{node.name} is used in {owner} but never defined")
            if terminal and not is_terminal(node.name):
                raise LarkSyntaxError(node.line, f"{owner} uses rule {node.name}: terminals can only use "
                                                 "terminals, strings and regexes")
        for child in _children(node):
            walk(child, owner, terminal)

    for name, body in grammar.definitions.items():
        walk(body, name, is_terminal(name))
    for node in grammar.ignored:
        walk(node, "%ignore", True)


def _children(node: Node) -> tuple[Node, ...]:
    if isinstance(node, Seq):
        return node.items
    if isinstance(node, Alt):
        return node.options
    if isinstance(node, Repeat):
        return (node.item,)
    return ()


def _emit(node: Node, in_rule: bool, grammar: Grammar, owner: str) -> Expr:
    """`node` as EBNF; `in_rule`: inside a rule of a grammar with %ignore, where each token is followed by the
    ignored ones."""
    if isinstance(node, Seq):
        parts = [paren(_emit(item, in_rule, grammar, owner), SEQ) for item in node.items]
        return (" ".join(parts), SEQ) if parts else ('""', ATOM)
    if isinstance(node, Alt):
        return " | ".join(_emit(option, in_rule, grammar, owner)[0] for option in node.options), ALT
    if isinstance(node, Repeat):
        return repeat_expr(_emit(node.item, in_rule, grammar, owner), node.low, node.high)
    if isinstance(node, Ref):
        token = is_terminal(node.name)
        expr = (_name(node.name), ATOM)
    else:
        token = True
        expr = _token(node, owner)
    return (f"{paren(expr, SEQ)} {_GAP}", SEQ) if in_rule and token else expr


def _token(node: Lit | Regex | Range, owner: str) -> Expr:
    if isinstance(node, Range):
        return char_class([(ord(node.low), ord(node.high))]), ATOM
    if isinstance(node, Lit):
        return (_any_case(node.text) if node.ignore_case else (quote(node.text), ATOM))
    try:
        return regex_to_ebnf(node.pattern, node.flags)
    except RegexError as e:
        raise LarkSyntaxError(node.line, f"the regex /{node.pattern}/{node.flags} in {owner} {e}") from None


def _any_case(text: str) -> Expr:
    """A string with `i`: each letter in either case (the cases `str` knows; Python's regex may match a few
    more characters, such as the Kelvin sign for k, which the output then never uses)."""
    parts = []
    for c in text:
        forms = {c, c.lower(), c.upper()} - {""}
        forms = {f for f in forms if len(f) == 1}
        parts.append(char_class([(ord(f), ord(f)) for f in forms]) if len(forms) > 1 else quote(c))
    return (" ".join(parts), SEQ) if len(parts) > 1 else (parts[0] if parts else '""', ATOM)



