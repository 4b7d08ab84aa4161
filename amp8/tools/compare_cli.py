"""``amp8 compare`` on the user's own model: the flags that name their callables
(``--model pkg.module:build_model --data pkg.module:batches ...``) or a transformers
config (``--hf-config NAME_OR_PATH --data FILE ...``), and the ``UserCompareConfig``
they make. The built-in models' flags live in ``cli.py``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from amp8.tools.experiments.user_config import UserCompareConfig

HF_EVAL_BATCHES = 8
"""Validation batches of ``--hf-config`` runs, from the held-out tenth of the text."""


def model_flag(value: str) -> str:
    """argparse's check of ``--model``: a built-in model's name, or ``module:attribute``.

    Raises:
        argparse.ArgumentTypeError: anything else, listing what it takes.
    """
    from amp8.tools.experiments.compare_config import MODELS

    if value in MODELS or is_object_path(value):
        return value
    raise argparse.ArgumentTypeError(
        f"invalid choice: {value!r} (choose from {', '.join(map(repr, MODELS))}, or name your own model's "
        "builder as pkg.module:build_model or path/to/file.py:build_model)"
    )


def is_object_path(value: str) -> bool:
    """Whether ``value`` reads as ``module:attribute`` (or ``file.py:attribute``)."""
    module, sep, attribute = value.rpartition(":")
    return bool(sep and module and attribute.replace(".", "_").isidentifier())


def import_object(value: str, flag: str) -> Any:
    """The object ``value`` names: ``pkg.module:name`` (imported as Python would, with
    the current folder on the path) or ``path/to/file.py:name``; dots in ``name`` reach
    attributes of attributes.

    Raises:
        ValueError: not of that form, a module that cannot be imported, or a name it
            lacks, each naming ``flag`` and the fix.
    """
    if not is_object_path(value):
        raise ValueError(f"{flag} {value!r} is not module:attribute; name it as pkg.module:name or path/to/file.py:name")
    module_name, _, attribute = value.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ValueError(f"{flag} {value!r}: there is no file {module_name}")
            name = f"amp8_compare_user_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None  # a .py file always has a loader
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # what the file defines (dataclasses, pickling) finds its module
            spec.loader.exec_module(module)
        else:
            module = _import_from_cwd(module_name)
    except ModuleNotFoundError as error:
        raise ValueError(
            f"{flag} {value!r}: cannot import {module_name!r} ({error}); run from the folder that holds it, add "
            "that folder to PYTHONPATH, or give the file: path/to/file.py:name"
        ) from None
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ValueError(f"{flag} {value!r}: {module_name} has no attribute {attribute!r}")
        found = getattr(found, part)
    return found


def _import_from_cwd(module_name: str) -> Any:
    """``importlib.import_module(module_name)``, finding the current folder's modules as
    ``python -m`` would (the folder is on ``sys.path`` during the import only)."""
    cwd = str(Path.cwd())
    added = "" not in sys.path and cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        if added:
            sys.path.remove(cwd)


def add_user_flags(compare: argparse.ArgumentParser) -> None:
    """The flags of ``amp8 compare`` on the user's own model."""
    own = compare.add_argument_group(
        "your own model",
        "--model pkg.module:build_model --data pkg.module:batches trains your model (a function returning a fresh "
        "nn.Module, or a module) on your batches (a list, a DataLoader, or a function returning one); "
        "--hf-config NAME_OR_PATH --data FILE ... trains a transformers causal LM built from a config (a local "
        "folder or config.json, or a model type such as llama, at --n-layer/--n-embd/--n-head) on text files, "
        "byte-level. Nothing is downloaded.",
    )
    own.add_argument("--data", nargs="+", metavar="OBJECT_OR_FILE",
                     help="the training batches as module:name; with --hf-config, text files")
    own.add_argument("--loss", metavar="OBJECT",
                     help="module:name of loss(model, batch) -> scalar (default: model(**batch).loss, or model(batch))")
    own.add_argument("--eval-data", metavar="OBJECT", help="module:name of the validation batches")
    own.add_argument("--optimizer", metavar="OBJECT",
                     help="module:name of optimizer(params) -> torch.optim.Optimizer (default: AdamW, torch's defaults)")
    own.add_argument("--scheduler", metavar="OBJECT", help="module:name of scheduler(optimizer) -> LR scheduler")
    own.add_argument("--hf-config", metavar="NAME_OR_PATH",
                     help="build a transformers causal LM from this config (local folder or config.json, or a model "
                          "type built at --n-layer/--n-embd/--n-head/--block-size) and train it on --data text files")
    own.add_argument("--eval-interval", type=int, help="steps between validation losses (default: a fifth of the steps)")
    own.add_argument("--threshold", type=float, default=None,
                     help="largest gap to O0, in percent, at which a level is still recommended (default: 0.5)")


def is_user_form(args: argparse.Namespace) -> bool:
    """Whether the flags ask for the user's own model (``--data``, ``--hf-config`` or
    ``--model module:name``)."""
    return bool(args.data or args.hf_config or is_object_path(args.model))


def user_config(args: argparse.Namespace, recipe: Any) -> "UserCompareConfig":
    """The ``UserCompareConfig`` the flags ask for.

    Raises:
        ValueError: a missing or unimportable object, or a value the configuration
            refuses, naming the flag.
        TypeError: an object of the wrong kind (e.g. an iterator as --data).
        ModuleNotFoundError: --hf-config without transformers, saying how to get it.
    """
    from amp8.tools.experiments.hf_text import HfCausalLM, HfShape, hf_config, text_data
    from amp8.tools.experiments.user_config import UserCompareConfig

    if not args.data:
        raise ValueError("your own model needs --data: module:name of the training batches "
                         "(or, with --hf-config, text files)")
    options: dict[str, Any] = {}
    if args.hf_config:
        if is_object_path(args.model):
            raise ValueError("give either --hf-config or --model module:name, not both")
        shape = HfShape(**{key: getattr(args, key) for key in ("n_layer", "n_embd", "n_head", "block_size")
                           if getattr(args, key) is not None})
        model: Any = HfCausalLM(hf_config(args.hf_config, shape))
        steps = 300 if args.steps is None else args.steps
        data, eval_data = text_data(args.data, args.batch_size, shape.block_size, steps, HF_EVAL_BATCHES)
        options["name"] = f"{type(model.config).__name__} from {args.hf_config}"
    else:
        if not is_object_path(args.model):
            raise ValueError(f"--data with --model {args.model!r}: name your model's builder as "
                             "--model pkg.module:build_model (or use --hf-config), or leave out --data for the "
                             "built-in models")
        if len(args.data) != 1:
            raise ValueError(f"--data takes one module:name without --hf-config, got {len(args.data)} values")
        model = import_object(args.model, "--model")
        data = import_object(args.data[0], "--data")
        eval_data = None if args.eval_data is None else import_object(args.eval_data, "--eval-data")
        steps = args.steps
    for flag in ("loss", "optimizer", "scheduler"):
        value = getattr(args, flag)
        if value is not None:
            options[flag] = import_object(value, f"--{flag}")
    if args.threshold is not None:
        options["threshold_percent"] = args.threshold
    return UserCompareConfig(
        model=model, data=data, eval_data=eval_data, steps=steps, levels=tuple(args.levels), seeds=args.seeds,
        seed=args.seed, device=args.device, recipe=recipe, eval_interval=args.eval_interval, **options,
    )
