"""Help text of the command line (``kvbaton`` and every ``kvbaton bench NAME``): the docstrings it is
made from, without their reST and Markdown markup. A leaf: the CLI and the benchmarks both use it."""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")  # :class:`~kvbaton.X` (reST roles of the docstrings)
_LITERAL = re.compile(r"``([^`]+)``|`([^`]+)`")


def plain(text: str) -> str:
    """Help text without the reST and Markdown markup of the docstrings it comes from: roles and
    backticks dropped (``:mod:`kvbaton.bench.x``` is ``kvbaton.bench.x``, ``:class:`~a.B``` is ``B``)."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return _LITERAL.sub(lambda m: m.group(1) or m.group(2), text)


class _Plain(argparse.HelpFormatter):
    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain(super()._expand_help(action))


def plain_formatter(base: type[argparse.HelpFormatter] = argparse.HelpFormatter) -> type[argparse.HelpFormatter]:
    """``base`` (an argparse formatter class) writing its help text :func:`plain`."""
    return type(f"Plain{base.__name__}", (_Plain, base), {})
