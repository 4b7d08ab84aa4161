"""The ``amp8`` command."""

from __future__ import annotations

import argparse
from typing import Sequence

from rich.console import Console
from rich.table import Table

from .console import default_console
from .levels import LEVELS


def print_levels(console: Console) -> None:
    """Print the precision table, one row per opt level, then each level's brief."""
    table = Table(title="amp8 opt levels")
    table.add_column("level")
    columns = list(LEVELS["O0"].columns())
    for column in columns:
        table.add_column(column)
    for level in LEVELS.values():
        table.add_row(level.name, *level.columns().values())
    console.print(table)
    for level in LEVELS.values():
        console.print(f"[bold]{level.name}[/bold]: {level.brief}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``amp8`` console script."""
    parser = argparse.ArgumentParser(prog="amp8", description="FP8 mixed-precision training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    levels = commands.add_parser("levels", help="print the precision table of the opt levels")
    levels.add_argument("--verbose", "-v", action="store_true", help="also print each level's description")
    args = parser.parse_args(argv)
    console = default_console()
    if args.command == "levels":
        print_levels(console)
        if args.verbose:
            console.print()
            for level in LEVELS.values():
                console.print(f"[bold]{level.name}[/bold]: {level.description}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
