"""amp8's old module paths (from before the package's folders became its layers) and
what each one gives now: one table, read by one import finder.

``import amp8.scaling``, ``from amp8.comm import GradientReduction`` or
``import amp8.experiments.compare`` give the module under its new path, the very same
module object, with a ``DeprecationWarning`` naming that path, for one release
(``MOVED_MODULES``; a path under an old package maps to the same path under the new one).
A path whose module is gone, or whose name on the ``amp8`` package now means something
else, fails with a ``ModuleNotFoundError`` that says what to import instead
(``GONE_MODULES``).

Python resolves ``import amp8.scaling`` through ``sys.meta_path``, never through the
``amp8`` package's attributes, so ``import amp8`` puts one ``OldPathFinder`` there. It
answers for the paths these tables name, all under ``amp8.``, and for no other: every
other import in the process goes on exactly as before. It sits first because a path under
an old package (``amp8.comm.fsdp``) would otherwise be found by Python's own finder in the
new package's folder and run that file a second time as another module.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import CodeType, ModuleType
from typing import Sequence

MOVED_MODULES: dict[str, str] = {
    "amp8.activations": "amp8.nn.activations",
    "amp8.block_scaled_gemm": "amp8.ops.block_scaled",
    "amp8.checks": "amp8.quant.checks",
    "amp8.cli": "amp8.tools.cli",
    "amp8.comm": "amp8.distributed",
    "amp8.console": "amp8.monitor.console",
    "amp8.controller": "amp8.monitor.controller",
    "amp8.controller_config": "amp8.config.controller",
    "amp8.experiments": "amp8.tools.experiments",
    "amp8.formats": "amp8.config.formats",
    "amp8.gemm": "amp8.ops.gemm",
    "amp8.hadamard": "amp8.quant.hadamard",
    "amp8.health": "amp8.quant.health",
    "amp8.hooks": "amp8.nn.hooks",
    "amp8.levels": "amp8.config.levels",
    "amp8.memory": "amp8.nn.memory",
    "amp8.microscaling": "amp8.tensor.block_scaled",
    "amp8.noise": "amp8.quant.noise",
    "amp8.recipe": "amp8.config.recipe",
    "amp8.scale_layout": "amp8.quant.scale_layout",
    "amp8.scaling": "amp8.quant.scaling",
    "amp8.selection": "amp8.nn.selection",
    "amp8.validation": "amp8.config.validation",
    "amp8.weight_grad": "amp8.tensor.weight_grad",
    "amp8.weight_grad_ops": "amp8.tensor.weight_grad_ops",
    "amp8.weight_stats": "amp8.monitor.weight_stats",
}
"""Old path -> the module's path now: the old one still imports, with a warning, until the
next release."""

GONE_MODULES: dict[str, str] = {
    # Importing a module sets the package's attribute of its name to it, so these two
    # cannot be aliases: ``amp8.report`` would stop being the function, and
    # ``amp8.stored_weight`` the (deprecated) name of ``amp8.tensor.stored_weight``.
    "amp8.report": "is the function amp8.report(model, optimizer) now; the module moved to amp8.monitor.report "
    "(import amp8.monitor.report)",
    "amp8.stored_weight": "moved to amp8.tensor.stored (import amp8.tensor.stored; StoredWeight and "
    "stored_weight are also in amp8.tensor)",
    "amp8.integrations": "was removed: Accelerate needs no adapter. Call amp8.initialize first, then "
    "accelerator.prepare, then amp8.distributed.register_ddp on the DDP it returns; accelerator.clip_grad_norm_ "
    "works unchanged (docs/integrations.md)",
}
"""Old path -> what to do instead: importing the old path fails with this."""


def _under(fullname: str, table: dict[str, str]) -> tuple[str, str] | None:
    """The entry of ``table`` whose path is ``fullname`` or a package above it, and the rest
    of ``fullname`` below it (``".fsdp"`` for ``amp8.comm.fsdp``)."""
    for old in table:
        if fullname == old or fullname.startswith(old + "."):
            return old, fullname[len(old):]
    return None


def moved_home(fullname: str) -> str | None:
    """The module's path now for the old path ``fullname`` (``amp8.comm.fsdp`` ->
    ``amp8.distributed.fsdp``), or None where ``fullname`` is no moved path."""
    found = _under(fullname, MOVED_MODULES)
    return None if found is None else MOVED_MODULES[found[0]] + found[1]


def gone_error(fullname: str) -> ModuleNotFoundError | None:
    """The error for importing the old path ``fullname`` whose module is gone, saying what
    to import instead; None where ``fullname`` is no such path."""
    found = _under(fullname, GONE_MODULES)
    if found is None:
        return None
    return ModuleNotFoundError(f"{found[0]} {GONE_MODULES[found[0]]}", name=fullname)


def warn_moved(old: str, home: str, stacklevel: int) -> None:
    """The ``DeprecationWarning`` for the old path ``old`` of the module at ``home``,
    pointed ``stacklevel`` frames up from here (past the import system's own)."""
    warnings.warn(f"{old} moved to {home}; import that: the old path goes in the next release",
                  DeprecationWarning, stacklevel=stacklevel + 1)


class _AliasLoader(Loader):
    """Loads an old path as the module at its new path (``home``)."""

    def __init__(self, home: str) -> None:
        self.home = home

    def create_module(self, spec: ModuleSpec) -> None:
        """The default (a placeholder that ``exec_module`` replaces)."""
        return None

    def exec_module(self, module: ModuleType) -> None:
        """Warn, and put the module at ``home`` in ``sys.modules`` under the old path,
        which the import then returns (the import system's documented replacement)."""
        warn_moved(module.__name__, self.home, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(self.home)

    def get_code(self, fullname: str) -> CodeType | None:
        """The code of the module at ``home``, for ``python -m <old path>`` (runpy runs it
        as ``__main__``), with the warning."""
        warn_moved(fullname, self.home, stacklevel=2)
        spec = importlib.util.find_spec(self.home)
        return None if spec is None else spec.loader.get_code(self.home)  # type: ignore[union-attr]


class OldPathFinder(MetaPathFinder):
    """Finds amp8's old module paths (``MOVED_MODULES``, ``GONE_MODULES``) and nothing else."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        """A spec that loads the moved module for an old path; raises the path's
        ``ModuleNotFoundError`` for a gone one; None for every other name."""
        if not fullname.startswith("amp8."):
            return None
        error = gone_error(fullname)
        if error is not None:
            raise error
        home = moved_home(fullname)
        return None if home is None else ModuleSpec(fullname, _AliasLoader(home))


def install() -> None:
    """Put one ``OldPathFinder`` first in ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPathFinder())
