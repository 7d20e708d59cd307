"""Lark's regular-expression terminals (`/.../flags`, Python `re` syntax) as xgrammar EBNF expressions.

The pattern is read by Python's own regex parser, the one Lark compiles it with, so escapes, classes and
quantifiers mean exactly what they mean to Lark. What a context-free grammar can say converts exactly:
literals, classes (`\\d`, `\\w`, `\\s` with their full Unicode sets, as `re` has them), `.`, groups,
alternation, greedy and lazy quantifiers (a whole match is the same set of strings either way). What it
cannot say is refused by name: anchors and word boundaries, lookarounds, backreferences, conditional and
atomic groups, possessive quantifiers, and case-insensitive matching (`i`).
"""

from __future__ import annotations

import functools
import re
import re._constants as sre  # Python >= 3.11, as the package requires
import re._parser as sre_parse

_MAX = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)  # not characters UTF-8 can carry, so never in a model's output
Ranges = list[tuple[int, int]]  # sorted, disjoint, inclusive code point ranges

# Precedence of an emitted expression: what may stand around it without parentheses.
ALT, SEQ, POSTFIX, ATOM = 0, 1, 2, 3
Expr = tuple[str, int]

_REFUSED = {
    sre.AT: "anchors and word boundaries (^, $, \\A, \\Z, \\b, \\B)",
    sre.ASSERT: "lookahead and lookbehind assertions",
    sre.ASSERT_NOT: "lookahead and lookbehind assertions",
    sre.GROUPREF: "backreferences",
    sre.GROUPREF_EXISTS: "conditional groups",
    sre.ATOMIC_GROUP: "atomic groups",
    sre.POSSESSIVE_REPEAT: "possessive quantifiers",
}


class RegexError(ValueError):
    """A pattern that does not parse, or uses a construct a grammar cannot express (the message says which)."""


def regex_to_ebnf(pattern: str, flags: str = "") -> Expr:
    """The EBNF expression matching exactly the strings `pattern` (with Lark's flags) fully matches."""
    try:
        parsed = sre_parse.parse(f"(?{flags}){pattern}" if flags else pattern)
    except re.error as e:
        raise RegexError(f"does not parse as a Python regular expression: {e}") from None
    if parsed.state.flags & re.IGNORECASE:
        raise RegexError("uses case-insensitive matching (the i flag), which is not supported")
    return _sequence(list(parsed), bool(parsed.state.flags & re.DOTALL))


def _sequence(items: list, dotall: bool) -> Expr:
    parts: list[Expr] = []
    text = ""  # consecutive literal characters, emitted as one string
    for op, arg in items:
        if op is sre.LITERAL:
            text += chr(arg)
            continue
        if text:
            parts.append((quote(text), ATOM))
            text = ""
        parts.append(_item(op, arg, dotall))
    if text:
        parts.append((quote(text), ATOM))
    if len(parts) <= 1:
        return parts[0] if parts else ('""', ATOM)
    return " ".join(paren(part, SEQ) for part in parts), SEQ


def _item(op, arg, dotall: bool) -> Expr:
    if op in _REFUSED:
        raise RegexError(f"uses {_REFUSED[op]}, which a grammar cannot express")
    if op is sre.NOT_LITERAL:
        return char_class(complement([(arg, arg)])), ATOM
    if op is sre.ANY:
        return char_class(_universe() if dotall else complement([(10, 10)])), ATOM
    if op is sre.IN:
        return char_class(_class_ranges(arg)), ATOM
    if op is sre.CATEGORY:
        return char_class(_category(arg)), ATOM
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):  # lazy or greedy: the same strings match in full
        low, high, body = arg
        return repeat(_sequence(list(body), dotall), low, None if high == sre.MAXREPEAT else high)
    if op is sre.SUBPATTERN:
        _, add, remove, body = arg
        if add & re.IGNORECASE:
            raise RegexError("uses case-insensitive matching ((?i:...)), which is not supported")
        dotall = bool((dotall or add & re.DOTALL) and not remove & re.DOTALL)
        return _sequence(list(body), dotall)
    if op is sre.BRANCH:
        options = [_sequence(list(option), dotall)[0] for option in arg[1]]
        return " | ".join(options), ALT
    raise RegexError(f"uses {op}, which is not supported")


def repeat(body: Expr, low: int, high: int | None) -> Expr:
    """`body` repeated low..high times (high None: unbounded)."""
    if high == 0:
        return '""', ATOM
    operand = paren(body, ATOM)
    suffix = {(0, 1): "?", (0, None): "*", (1, None): "+"}.get((low, high))
    if suffix is None:
        suffix = f"{{{low}}}" if low == high else f"{{{low},{'' if high is None else high}}}"
    return operand + suffix, POSTFIX


def paren(expr: Expr, need: int) -> str:
    text, precedence = expr
    return text if precedence >= need else f"({text})"


# ---- characters -----------------------------------------------------------------------------------------

def quote(text: str) -> str:
    """An EBNF string literal of `text`."""
    return '"' + "".join(_escape(c, '"\\') for c in text) + '"'


def _escape(c: str, special: str) -> str:
    code = ord(c)
    if c in special:
        return "\\" + c
    if c in "\n\t\r":
        return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}[c]
    if code < 0x20 or 0x7F <= code < 0xA0 or 0xD800 <= code <= 0xDFFF:
        return f"\\u{code:04x}"
    return c


def _class_char(code: int) -> str:
    if code > 0x7E:
        return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
    return _escape(chr(code), "\\]-[^")


def char_class(ranges: Ranges) -> str:
    """An EBNF character class of exactly these code points, written as the shorter of it and its negation."""
    ranges = _without_surrogates(ranges)
    if not ranges:
        raise RegexError("has a character class that matches no character")
    rest = complement(ranges)
    if not rest:
        return f"[{_class_char(0)}-{_class_char(_MAX)}]"
    negate = len(rest) < len(ranges)
    body = "".join(_class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}"
                   for lo, hi in (rest if negate else ranges))
    return f"[^{body}]" if negate else f"[{body}]"


def normalize(ranges: Ranges) -> Ranges:
    """Sorted, merged ranges."""
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def complement(ranges: Ranges) -> Ranges:
    """Every character (surrogates aside) not in `ranges`."""
    out: Ranges = []
    start = 0
    for lo, hi in normalize(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = max(start, hi + 1)
    if start <= _MAX:
        out.append((start, _MAX))
    return _without_surrogates(out)


def _without_surrogates(ranges: Ranges) -> Ranges:
    low, high = _SURROGATES
    out: Ranges = []
    for lo, hi in normalize(ranges):
        if lo < low:
            out.append((lo, min(hi, low - 1)))
        if hi > high:
            out.append((max(lo, high + 1), hi))
    return out


def _universe() -> Ranges:
    return _without_surrogates([(0, _MAX)])


def _class_ranges(items: list) -> Ranges:
    """The code points of a `[...]` class's parsed items."""
    ranges: Ranges = []
    negate = False
    for op, arg in items:
        if op is sre.NEGATE:
            negate = True
        elif op is sre.LITERAL:
            ranges.append((arg, arg))
        elif op is sre.RANGE:
            ranges.append(arg)
        elif op is sre.CATEGORY:
            ranges.extend(_category(arg))
        else:
            raise RegexError(f"has {op} in a character class, which is not supported")
    return complement(ranges) if negate else normalize(ranges)


_CATEGORIES = {sre.CATEGORY_DIGIT: r"\d", sre.CATEGORY_NOT_DIGIT: r"\D", sre.CATEGORY_SPACE: r"\s",
               sre.CATEGORY_NOT_SPACE: r"\S", sre.CATEGORY_WORD: r"\w", sre.CATEGORY_NOT_WORD: r"\W"}


def _category(category) -> Ranges:
    if category not in _CATEGORIES:
        raise RegexError(f"uses {category}, which is not supported")
    return _category_ranges(_CATEGORIES[category])


@functools.cache
def _category_ranges(escape: str) -> Ranges:
    """The code points `re` itself matches with `escape` (\\d, \\w, \\s and their negations are Unicode-wide
    for str patterns): asked of `re` over every character, so the class is the one Lark's lexer has."""
    def code(index: int) -> int:  # the text below skips the surrogates
        return index if index < _SURROGATES[0] else index + _SURROGATES[1] - _SURROGATES[0] + 1

    runs = re.finditer(f"{escape}+", _all_characters())
    return _without_surrogates([(code(m.start()), code(m.end() - 1)) for m in runs])


@functools.cache
def _all_characters() -> str:
    """Every character but the surrogates, in code point order (a third of a second, once)."""
    return "".join(map(chr, range(_SURROGATES[0]))) + "".join(map(chr, range(_SURROGATES[1] + 1, _MAX + 1)))
