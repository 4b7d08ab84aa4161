"""The rich console amp8 prints to."""

from __future__ import annotations

from rich.console import Console

LOG_WIDTH = 160
"""Width used when the output is not a terminal (logs, pipes, CI), instead of rich's 80."""


def default_console() -> Console:
    """A console for stdout; wide when stdout is not a terminal, so tables stay unwrapped."""
    console = Console()
    return console if console.is_terminal else Console(width=LOG_WIDTH)
