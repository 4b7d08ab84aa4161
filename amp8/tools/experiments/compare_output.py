"""What both forms of ``amp8.compare`` share around their training: the output folder's
check, the progress bar, the environment they record, and the table, JSON and PNG they
leave behind."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch

from amp8.tools.experiments.compare_config import JSON_NAME, PNG_NAME
from amp8.tools.experiments.compare_plot import plot_result
from amp8.tools.experiments.compare_result import CompareResult
from amp8.tools.experiments.train import torchao_available


def check_out_dir(out_dir: str | Path | None) -> None:
    """Create ``out_dir`` now, so a folder that cannot be written fails before training.

    Raises:
        ValueError: the folder cannot be created, naming it and why.
    """
    if out_dir is None:
        return
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"out_dir={str(out_dir)!r} cannot be created ({error.strerror}); pick a folder you can write") from None


def progress_bar(console: Any, enabled: bool) -> Any:
    """The rich progress bar both forms show while training (disabled unless ``enabled``)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console, disable=not enabled)


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, device and threads, for the JSON."""
    from amp8._version import __version__

    return {
        "amp8": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "device": str(device), "threads": torch.get_num_threads(), "torchao": torchao_available(),
    }


def finish(result: CompareResult, out_dir: str | Path | None, console: Any, plot: bool) -> None:
    """Print ``result``'s table (and what goes under it), then write ``compare.json`` and
    ``loss_curves.png`` into ``out_dir`` (nothing when it is None); without matplotlib,
    say how to get the picture."""
    result.print(console)
    if out_dir is None:
        return
    out = Path(out_dir)
    console.print(f"wrote {result.write_json(out / JSON_NAME)}", highlight=False)
    if plot:
        try:
            console.print(f"wrote {plot_result(result, out / PNG_NAME)}", highlight=False)
        except ModuleNotFoundError as error:
            console.print(f"no plot: {error}", highlight=False, markup=False)
