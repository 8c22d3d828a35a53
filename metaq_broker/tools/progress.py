"""Progress bars on stderr that ``--progress`` can ask for even where stderr is no terminal (a CI log, a
pipe): click draws a bar only on a stream whose ``isatty()`` is true, so such a bar gets a stream that
says it is one, through ``click.progressbar``'s public ``file`` argument (not the bar's private state)."""
from __future__ import annotations

import io
import sys

import click


class _Terminal:
    """``stream``, said to be a terminal: click draws the bar on it, carriage returns and all."""

    def __init__(self, stream):
        self.stream = stream

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def progressbar(show: bool, **kw):
    """``click.progressbar(**kw)`` on stderr: drawn when ``show``, also where stderr is no terminal;
    otherwise silent (written to nowhere)."""
    return click.progressbar(file=_Terminal(sys.stderr) if show else io.StringIO(), **kw)
