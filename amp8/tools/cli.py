"""The ``amp8`` command."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Sequence

from rich.console import Console
from rich.table import Table

from amp8.config.levels import LEVELS
from amp8.config.recipe import ActivationFormat, Recipe, RecipeName
from amp8.monitor.console import default_console

if TYPE_CHECKING:
    from amp8.tools.experiments.compare import CompareConfig


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


def _add_compare(commands: Any) -> None:
    """The ``compare`` subcommand's options (defaults from ``CompareConfig``)."""
    from amp8.tools.compare_cli import add_user_flags, model_flag
    from amp8.tools.experiments.compare import MODELS, CompareConfig
    from amp8.tools.experiments.corpus import SOURCES
    from amp8.tools.experiments.gpt import PRESETS

    defaults = CompareConfig()
    compare = commands.add_parser(
        "compare",
        help="train the same model from the same seeds at every opt level and compare the losses",
        description=(
            "Train a byte-level model on the Python standard library's sources (or, with --corpus docs, "
            "the language reference) at O0-O3, plus FP8 without scaling (and torchao's float8 when "
            "installed); print a table of losses and gaps to O0, write JSON and a PNG of the loss curves "
            "and of each run's gap to O0. The model is a GPT with an output head of its own, as most "
            "Llama-style models have (--model gpt-tied ties it to the embedding, where it never runs in "
            "FP8; --model llama trains transformers' Llama, --model moe its mixture-of-experts sibling "
            "Mixtral). --seeds N trains every level from N seeds, "
            "each paired with O0 from the same seed, and prints each gap as mean ± standard error with "
            "the null variant's gap (O0 from weights perturbed by 1e-6) as the noise floor. The defaults "
            "take a few minutes on a laptop CPU. --stress injects a growing outlier on the first token "
            "of the last MLP's input, invisible in exact arithmetic, that tensorwise FP8 scales cannot hold. "
            "On your own model: --model pkg.module:build_model --data pkg.module:batches [--loss ...] "
            "[--eval-data ...] [--optimizer ...], or --hf-config NAME_OR_PATH --data FILE ...; "
            "either way the table ends with the recommended level."
        ),
    )
    compare.add_argument("--model", type=model_flag, default="gpt", metavar="{" + ",".join(MODELS) + "} or MODULE:NAME",
                         help="gpt: the GPT with an untied output head (default); gpt-tied: its head shares the "
                              "embedding's weight and stays in high precision; llama: transformers' "
                              "LlamaForCausalLM of the same shape; moe: transformers' MixtralForCausalLM of "
                              "that shape, 8 experts, 2 a token (both need transformers); or your own model: "
                              "pkg.module:build_model (a function returning a fresh nn.Module) with --data")
    compare.add_argument("--preset", choices=list(PRESETS), default="small",
                         help="model size, for the GPT and the Llama alike (default: small)")
    compare.add_argument("--n-layer", type=int, help="override the preset's number of blocks")
    compare.add_argument("--n-embd", type=int, help="override the preset's width (a multiple of 16)")
    compare.add_argument("--n-head", type=int, help="override the preset's attention heads")
    compare.add_argument("--block-size", type=int, help="override the preset's context length")
    compare.add_argument("--steps", type=int, default=None,
                         help=f"steps per run (default: {defaults.steps}; your own model: one pass over --data)")
    compare.add_argument("--batch-size", type=int, default=defaults.batch_size,
                         help=f"sequences per step (default: {defaults.batch_size})")
    compare.add_argument("--lr", type=float, default=defaults.lr, help=f"peak learning rate (default: {defaults.lr})")
    compare.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps,
                         help=f"steps of linear warm-up, 0 for none (default: {defaults.warmup_steps})")
    compare.add_argument("--weight-decay", type=float, default=defaults.weight_decay,
                         help=f"AdamW decay of matrices (default: {defaults.weight_decay})")
    compare.add_argument("--levels", nargs="+", default=list(defaults.levels), help="opt levels (default: all)")
    compare.add_argument("--seeds", type=int, default=1,
                         help="train every level, the torchao runs and the null variant from this many seeds "
                              "(--seed, --seed + 1, ...), each paired with O0 from the same seed; the table "
                              "shows each gap as mean ± standard error (default: 1)")
    compare.add_argument("--seed", type=int, default=0,
                         help="(first) seed of the weights and batch order (default: 0)")
    compare.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: cpu)")
    compare.add_argument("--max-bytes", type=int, default=defaults.corpus.max_bytes, help="corpus size in bytes")
    compare.add_argument("--corpus", choices=list(SOURCES), default=defaults.corpus.source,
                         help="the standard library's code or the language reference's prose "
                              f"(default: {defaults.corpus.source})")
    compare.add_argument("--recipe", choices=[name.value for name in RecipeName],
                         help="FP8 recipe preset of the O1-O3 runs (default: amp8.initialize's default recipe)")
    compare.add_argument("--activations", choices=[name.value for name in ActivationFormat],
                         help="how the O1-O3 runs store tensors saved for backward (default: the recipe's, high)")
    compare.add_argument("--high-precision-layers", nargs="+", metavar="PATTERN", default=(),
                         help="fnmatch patterns of layers the O1-O3 runs keep in high precision, "
                              "e.g. 'blocks.11.*' (Recipe.high_precision_layers)")
    compare.add_argument("--stress", action="store_true",
                         help="inject the default outlier stress (amp8.tools.experiments.stress.OutlierStress) into "
                              "every run and leave its position out of the loss")
    compare.add_argument("--controller", nargs="*", metavar="LEVEL", default=None,
                         help="train these FP8 levels once more with amp8.Controller() (no level: O1)")
    compare.add_argument("--no-ablation", action="store_true", help="skip the no-scaling ablation")
    compare.add_argument("--no-torchao", action="store_true", help="skip torchao's float8 even when installed")
    compare.add_argument("--out", default="runs/compare", help="output folder (default: runs/compare)")
    compare.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_user_flags(compare)


def _compare_config(args: argparse.Namespace) -> "CompareConfig":
    """The ``CompareConfig`` the flags ask for.

    Raises:
        ValueError: a value the configuration refuses, naming it.
        ModuleNotFoundError: --model llama or moe without transformers, saying how to get it.
    """
    from amp8.tools.experiments.compare import CompareConfig, model_config
    from amp8.tools.experiments.corpus import CorpusConfig
    from amp8.tools.experiments.stress import OutlierStress

    shape = {key: getattr(args, key) for key in ("n_layer", "n_embd", "n_head", "block_size")
             if getattr(args, key) is not None}
    changes = {} if args.threshold is None else {"threshold_percent": args.threshold}
    if args.eval_interval is not None:
        changes["eval_interval"] = args.eval_interval
    return CompareConfig(
        model=model_config(args.model, args.preset, **shape), steps=CompareConfig().steps if args.steps is None else args.steps,
        batch_size=args.batch_size,
        lr=args.lr, levels=tuple(args.levels), warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        ablation=not args.no_ablation, torchao=not args.no_torchao, seeds=args.seeds, seed=args.seed,
        device=args.device, corpus=CorpusConfig(max_bytes=args.max_bytes, source=args.corpus),
        recipe=_recipe(args), stress=OutlierStress() if args.stress else None,
        controller_levels=() if args.controller is None else tuple(args.controller or ["O1"]), **changes,
    )


def _recipe(args: argparse.Namespace) -> Recipe | None:
    """The recipe the flags ask for: None (``initialize``'s default) unless --recipe,
    --activations or --high-precision-layers is given; then the preset (``Recipe()``
    without --recipe) with those changes."""
    if args.recipe is None and args.activations is None and not args.high_precision_layers:
        return None
    recipe = Recipe() if args.recipe is None else Recipe.preset(args.recipe)
    changes: dict[str, Any] = {"high_precision_layers": tuple(args.high_precision_layers)} if args.high_precision_layers else {}
    if args.activations is not None:
        changes["activations"] = args.activations
    return recipe.replace(**changes)


def _add_report(commands: Any) -> None:
    report = commands.add_parser(
        "report",
        help="print the precision report of a compare run's final model",
        description="Print the precision report of the final model of one run of `amp8 compare`.",
    )
    report.add_argument("--run", default="runs/compare",
                        help="the compare output folder or its compare.json, or a report log (.jsonl, amp8.ReportLog)")
    report.add_argument("--level", default="O1", help="which run: O0, O1, O2, O3, O1-noscale, ... (default: O1)")
    report.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    report.add_argument("--png", help="also draw the report as a heatmap into this PNG (needs matplotlib)")
    report.add_argument("--full", action="store_true",
                        help="one row per tensor (the default folds repeated blocks into one row per role)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``amp8`` console script."""
    parser = argparse.ArgumentParser(prog="amp8", description="FP8 mixed-precision training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    levels = commands.add_parser("levels", help="print the precision table of the opt levels")
    levels.add_argument("--verbose", "-v", action="store_true", help="also print each level's description")
    _add_compare(commands)
    _add_report(commands)
    args = parser.parse_args(argv)
    console = default_console()
    if args.command == "compare":
        from amp8.tools.compare_cli import is_user_form, user_config
        from amp8.tools.experiments.compare import compare

        try:
            config = user_config(args, _recipe(args)) if is_user_form(args) else _compare_config(args)
        except (ValueError, TypeError, ModuleNotFoundError, FileNotFoundError) as error:
            parser.error(str(error))
        try:
            compare(config, out_dir=args.out, console=console, progress=not args.no_progress)
        except (ValueError, TypeError, RuntimeError) as error:  # an output folder that cannot be written, before
            if not isinstance(error, ValueError) and not is_user_form(args):  # any training; your own model's
                raise                                                        # data, loss or O0 run refused
            parser.error(str(error))
    elif args.command == "report" and str(args.run).endswith(".jsonl"):
        from amp8.monitor.report_log import drift_lines, read_log

        try:
            records = read_log(args.run)
        except (FileNotFoundError, ValueError) as error:  # missing, empty or not a log: says what writes one
            console.print(f"amp8 report: {error}", highlight=False, markup=False, soft_wrap=True)
            return 2
        for line in drift_lines(records):
            console.print(line, highlight=False, markup=False)
    elif args.command == "report":
        from amp8.tools.experiments.compare import load_report

        try:
            precision = load_report(args.run, args.level)
        except (FileNotFoundError, KeyError, ValueError) as error:
            console.print(f"amp8 report: {error.args[0]}", highlight=False, markup=False)
            return 2
        if args.json:
            print(precision.to_json(indent=1))
        else:
            console.print(f"[bold]{args.level}[/bold] after `amp8 compare` ({args.run})")
            precision.print(console, full=args.full)
        if args.png:
            try:
                console.print(f"wrote {precision.plot(args.png)}", highlight=False)
            except (ModuleNotFoundError, ValueError) as error:
                console.print(f"amp8 report: no picture: {error}", highlight=False, markup=False)
                return 2
    if args.command == "levels":
        print_levels(console)
        if args.verbose:
            console.print()
            for level in LEVELS.values():
                console.print(f"[bold]{level.name}[/bold]: {level.description}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
