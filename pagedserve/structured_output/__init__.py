"""Structured outputs: constraints compiled to xgrammar grammars and the per-sequence matchers that mask each
draw (`grammars.py`); Lark grammars translated to xgrammar's EBNF (`lark_*.py`)."""
