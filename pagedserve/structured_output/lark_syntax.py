"""Reading a grammar in Lark's syntax: its definitions and statements as plain data (`Grammar`), each
expansion a tree of `Node`s, with the line each came from for errors.

As Lark reads it: a definition ends at the end of its line unless the next line begins with `|`; comments
are `//` and `#` to the end of the line; strings are `"..."` (with `i` for any case), regexes `/.../flags`,
ranges `"a".."z"`, operators `? * + ~N ~N..M`, `[...]` optional, `-> alias`, `name.N` priorities, rule
modifiers `? ! _`. Two leniencies, as vLLM's converter has them: strings in single quotes, and lines that
continue inside open brackets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


class LarkSyntaxError(ValueError):
    """A grammar that is not Lark, or uses what cannot be converted; the message names the line."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")


@dataclass(frozen=True)
class Lit:
    text: str
    ignore_case: bool = False


@dataclass(frozen=True)
class Regex:
    pattern: str
    flags: str
    line: int


@dataclass(frozen=True)
class Range:
    low: str
    high: str


@dataclass(frozen=True)
class Ref:
    name: str
    line: int


@dataclass(frozen=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    item: Node
    low: int
    high: int | None  # None: unbounded


Node = Lit | Regex | Range | Ref | Seq | Alt | Repeat


@dataclass
class Grammar:
    definitions: dict[str, Node] = field(default_factory=dict)  # rules and terminals, in order
    lines: dict[str, int] = field(default_factory=dict)  # where each was defined
    ignored: list[Node] = field(default_factory=list)  # %ignore's expansions
    imports: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (common terminal, line)


def is_terminal(name: str) -> bool:
    """Lark's convention: UPPERCASE names are terminals, lowercase ones rules (a leading `_` aside)."""
    return name.lstrip("_")[:1].isupper()


_TOKEN = re.compile(r"""
    (?P<skip>[ \t\f]+|\\[ \t]*\r?\n|(?://|\#)[^\n]*)
  | (?P<nl>\r?\n)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?|'(?:\\.|[^'\\\n])*'i?)
  | (?P<regex>/(?!/)(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<punct>->|\.\.|[.:|()\[\]{},~?*+!])
  | (?P<directive>%[a-z]+)
  | (?P<name>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<number>[+-]?[0-9]+)
""", re.VERBOSE)


@dataclass(frozen=True)
class _Token:
    kind: str  # "nl", "string", "regex", "punct", "directive", "name", "number", "end"
    text: str
    line: int


def _tokens(text: str) -> list[_Token]:
    """The grammar's tokens; a newline only where it ends a definition (not before `|`, not in brackets)."""
    tokens: list[_Token] = []
    line, pos, depth = 1, 0, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise LarkSyntaxError(line, f"unexpected {text[pos]!r}")
        kind, value = m.lastgroup, m.group()
        pos = m.end()
        if kind == "punct" and value == "|":
            while tokens and tokens[-1].kind == "nl":
                tokens.pop()  # `|` at a line's start continues the definition above
        if kind == "punct" and value in "([{":
            depth += 1
        elif kind == "punct" and value in ")]}":
            depth -= 1
        if kind not in ("skip", "nl") or (kind == "nl" and depth <= 0 and tokens and tokens[-1].kind != "nl"):
            tokens.append(_Token(kind, value, line))
        line += value.count("\n")
    tokens.append(_Token("nl", "\n", line))
    tokens.append(_Token("end", "", line))
    return tokens


def unescape_string(token: str, line: int) -> tuple[str, bool]:
    """A string token's characters and whether it ignores case, as Lark reads a string: a backslash before
    another or before the string's own quote is that character; `\\n \\t \\r \\f \\xHH \\uHHHH \\UHHHHHHHH`
    are Python's escapes; any other backslash stands for itself."""
    ignore_case = token.endswith("i")
    body = token[1:-2] if ignore_case else token[1:-1]
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = body[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(nxt)
        if width is not None:
            digits = body[i + 2:i + 2 + width]
            if not re.fullmatch(f"[0-9a-fA-F]{{{width}}}", digits):
                raise LarkSyntaxError(line, f"bad escape \\{nxt}{digits} in {token}")
            out.append(chr(int(digits, 16)))
            i += 2 + width
            continue
        simple = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "\\": "\\", token[0]: token[0]}
        out.append(simple.get(nxt, "\\" + nxt))
        i += 2
    return "".join(out), ignore_case


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.pos = 0
        self.grammar = Grammar()

    def peek(self, text: str | None = None, kind: str | None = None) -> bool:
        token = self.tokens[self.pos]
        return (text is None or token.text == text) and (kind is None or token.kind == kind)

    def take(self, text: str | None = None, kind: str | None = None, what: str = "") -> _Token:
        token = self.tokens[self.pos]
        if not self.peek(text, kind):
            found = "the end of the line" if token.kind == "nl" else repr(token.text) or "the end"
            raise LarkSyntaxError(token.line, f"expected {what or text or kind}, found {found}")
        self.pos += 1
        return token

    def grammar_(self) -> Grammar:
        while not self.peek(kind="end"):
            if self.peek(kind="nl"):
                self.pos += 1
            elif self.peek(kind="directive"):
                self.statement()
            else:
                self.definition()
        return self.grammar

    def definition(self) -> None:
        while self.peek("?") or self.peek("!"):  # rule modifiers: inline, keep tokens (the tree's shape only)
            self.pos += 1
        name = self.take(kind="name", what="a rule or terminal name")
        if self.peek("{"):
            raise LarkSyntaxError(name.line, f"{name.text}{{...}}: templates are not supported")
        if self.peek("."):  # a priority: it orders the parses of an ambiguous text, the language is the same
            self.pos += 1
            self.take(kind="number", what="a priority number")
        self.take(":", what=f"':' after {name.text}")
        body = self.expansions()
        self.take(kind="nl", what="the end of the definition")
        self.define(name.text, body, name.line)

    def define(self, name: str, body: Node | None, line: int) -> None:
        if name in self.grammar.lines:
            raise LarkSyntaxError(line, f"{name} is defined twice (also on line {self.grammar.lines[name]})")
        self.grammar.lines[name] = line
        if body is not None:
            self.grammar.definitions[name] = body

    def statement(self) -> None:
        token = self.take(kind="directive")
        if token.text == "%ignore":
            self.grammar.ignored.append(self.expansions())
        elif token.text == "%import":
            self.import_(token.line)
        else:
            raise LarkSyntaxError(token.line, f"{token.text} is not supported (only %import and %ignore are)")
        self.take(kind="nl", what=f"the end of {token.text}")

    def import_(self, line: int) -> None:
        if self.peek("."):
            raise LarkSyntaxError(line, "%import from a relative path: only Lark's common module can be imported")
        path = [self.take(kind="name", what="a module name after %import").text]
        while self.peek("."):
            self.pos += 1
            path.append(self.take(kind="name").text)
        if path[0] != "common":
            raise LarkSyntaxError(line, f"%import {'.'.join(path)}: only terminals of Lark's common module "
                                        "can be imported")
        if self.peek("("):  # %import common (A, B)
            self.pos += 1
            names = [self.take(kind="name").text]
            while self.peek(","):
                self.pos += 1
                names.append(self.take(kind="name").text)
            self.take(")")
            imported = [(name, name) for name in names]
        elif len(path) == 2:  # %import common.A [-> B]
            alias = path[1]
            if self.peek("->"):
                self.pos += 1
                alias = self.take(kind="name").text
            imported = [(path[1], alias)]
        else:
            raise LarkSyntaxError(line, f"%import {'.'.join(path)}: expected common.NAME or common (NAME, ...)")
        for name, alias in imported:
            self.define(alias, None, line)
            self.grammar.imports[alias] = (name, line)

    def expansions(self) -> Node:
        options = [self.alias()]
        while self.peek("|"):
            self.pos += 1
            options.append(self.alias())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def alias(self) -> Node:
        items: list[Node] = []
        while not (self.peek(kind="nl") or self.peek(kind="end") or any(self.peek(t) for t in "|)]") or
                   self.peek("->")):
            items.append(self.expr())
        if self.peek("->"):  # names the tree's node: the language is the same
            self.pos += 1
            self.take(kind="name", what="an alias name after ->")
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def expr(self) -> Node:
        atom = self.atom()
        token = self.tokens[self.pos]
        if token.text in ("?", "*", "+"):
            self.pos += 1
            return Repeat(atom, *{"?": (0, 1), "*": (0, None), "+": (1, None)}[token.text])
        if token.text == "~":
            self.pos += 1
            low = int(self.take(kind="number", what="a count after ~").text)
            high = low
            if self.peek(".."):
                self.pos += 1
                high = int(self.take(kind="number", what="a count after ..").text)
            if not 0 <= low <= high:
                raise LarkSyntaxError(token.line, f"~ {low}..{high} is not a range of counts")
            return Repeat(atom, low, high)
        return atom

    def atom(self) -> Node:
        token = self.tokens[self.pos]
        if token.text in ("(", "["):
            self.pos += 1
            inner = self.expansions()
            self.take(")" if token.text == "(" else "]")
            return inner if token.text == "(" else Repeat(inner, 0, 1)
        self.pos += 1
        if token.kind == "name":
            if self.peek("{"):
                raise LarkSyntaxError(token.line, f"{token.text}{{...}}: templates are not supported")
            return Ref(token.text, token.line)
        if token.kind == "regex":
            end = token.text.rindex("/")
            return Regex(token.text[1:end], token.text[end + 1:], token.line)
        if token.kind == "string":
            text, ignore_case = unescape_string(token.text, token.line)
            if not self.peek(".."):
                return Lit(text, ignore_case)
            self.pos += 1
            high, _ = unescape_string(self.take(kind="string", what="a string after ..").text, token.line)
            if len(text) != 1 or len(high) != 1 or ignore_case:
                raise LarkSyntaxError(token.line, "a range \"a\"..\"z\" takes one character at each end")
            return Range(text, high)
        found = "the end of the line" if token.kind == "nl" else repr(token.text)
        raise LarkSyntaxError(token.line, f"expected a name, string, regex or group, found {found}")


def parse(text: str) -> Grammar:
    """The grammar's definitions and statements; LarkSyntaxError naming the line otherwise."""
    return _Parser(text).grammar_()
