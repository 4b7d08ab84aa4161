"""amp8 under the user's ``DistributedDataParallel``: ``register_ddp``, and what DDP must
leave to amp8.

The order of calls, in every process after ``init_process_group``::

    model, optimizer = amp8.initialize(model, optimizer, opt_level="O2")
    model = torch.nn.parallel.DistributedDataParallel(model)
    amp8.distributed.register_ddp(model)

``initialize`` lists the FP8 layers' weights and buffers in the model's
``_ddp_params_and_buffers_to_ignore``, the list DDP reads when it is built, because their
gradients are FP8 tensors DDP's buckets cannot hold and gloo cannot send FP8 buffers.
DDP then does what it does for every other parameter (broadcast at wrap, buckets,
``no_sync``, ``find_unused_parameters``, ``static_graph``). ``register_ddp`` hands the
DDP to amp8: it checks that DDP leaves the FP8 weights alone, takes DDP's process group
for amp8's reduction of the FP8 weight gradients (which from then on covers those alone,
FP8 on the wire), registers ``fp8_compress_hook`` on the DDP (``comm_hook=True``) so the
other gradients travel in FP8 too, and puts two hooks on the DDP itself: a forward
pre-hook reads ``require_backward_grad_sync`` (False inside ``no_sync()``), so the FP8
weights' reduction pauses with DDP's; a forward hook, under
``find_unused_parameters=True``, has the FP8 weights' gradients averaged when each
backward ends (a rank may leave FP8 weights without a gradient, LayerDrop or MoE
routing, that another rank gives one: started as gradients come, the collectives would
come in different orders on different ranks), on every rank alike, after DDP has started
its own collectives.

Why registration is explicit. amp8 used to find the DDP at the model's first forward and
register its comm hook silently. A DDP is the user's object: registering a comm hook on it
changes how it reduces, and DDP takes one hook only, so the user decides (``comm_hook``)
at a call they can see, before any backward. Finding the DDP from inside the model needs
either DDP's private record of the module it is running or a look at the Python call
stack; the first is not torch's public API, and the second is good enough to refuse a
setup but not to build the run's reduction on (a compiled forward cannot walk the stack).

Trainers that build the DDP themselves (Hugging Face ``Trainer`` through Accelerate,
Lightning's DDP strategy) give the user no point between wrapping and the first forward.
``register_ddp_when_wrapped(module)``, called on the module the trainer will wrap, is the
explicit call for them: it puts amp8's names in that module's ignore list (the trainer may
wrap a module that holds the amp8 model, as Lightning wraps the ``LightningModule``) and
has the guard below register the DDP it finds at the first forward, with the same checks
and hooks as ``register_ddp``. The first forward with grad must run eagerly for that: a
forward compiled whole skips the guard (as it skips the refusal below), so register the
DDP of such a trainer with ``register_ddp``.

An unregistered DDP fails. ``initialize`` puts a forward pre-hook on the model
(``DdpGuard``) that looks up the Python call stack for ``DistributedDataParallel.forward``
running this model (public frame attributes, ``inspect``). A DDP found there that was not
registered (or any DDP around an O3 model, whose FP8 weights FSDP2 shards) raises a
``RuntimeError`` naming ``amp8.distributed.register_ddp`` at the first forward, before
any gradient is averaged twice. It runs in eager forwards with grad enabled (a forward
under ``torch.compile`` skips it: Dynamo does not trace a walk of the stack) and costs a
walk of the stack per forward, microseconds. A copy of the model (``copy.deepcopy``, for
evaluation or an EMA) gets a guard with no process group, which refuses any DDP: no
optimizer averages the copy's gradients (see ``DdpGuard``).

Two uses of torch names that begin with an underscore remain, each with no public
equivalent (listed with their reasons in ``tests/test_private_api.py``): the ignore list
is DDP's ``_ddp_params_and_buffers_to_ignore`` attribute, set directly (DDP's own setter
is a private static method), and the end-of-backward averaging queues its callback with
the autograd engine (``torch.autograd.Variable._execution_engine.queue_callback``), as
torch's own DDP comm hooks and FSDP do.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from amp8.distributed.comm_hook import fp8_compress_hook
from amp8.distributed.data_parallel import DataParallelGroup
from amp8.distributed.ddp_watch import DdpWatch
from amp8.distributed.reduction import GradientReduction
from amp8.nn.hooks import forward_pre_hook_owners, remove_forward_hooks
from amp8.tensor.stored import StoredWeight, stored_weight

DDP = nn.parallel.DistributedDataParallel

_DDP_FORWARD = inspect.unwrap(DDP.forward).__code__
"""The code of ``DistributedDataParallel.forward``: a frame running it is a DDP's forward."""

_SHARDED_MESSAGE = (
    "DistributedDataParallel wraps a model whose FP8 weights amp8 sharded with FSDP2 (opt level "
    "O3 in a process group): amp8 averages every gradient itself there; use the model without "
    "DDP, or O1/O2 under DDP"
)


_COPY_MESSAGE = (
    "DistributedDataParallel wraps a copy (copy.deepcopy) of an amp8 model: amp8 averages the "
    "FP8 weights' gradients of the model amp8.initialize returned only, with the optimizer it "
    "returned; train that model under DDP, use the copy for evaluation or as an EMA (under "
    "torch.no_grad()), or hand amp8.initialize a plain copy, amp8.export(model)"
)


def register_ddp(
    ddp: nn.parallel.DistributedDataParallel,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    comm_hook: bool = True,
) -> nn.parallel.DistributedDataParallel:
    """Hand the user's ``DistributedDataParallel`` around an amp8 model to amp8; returns it.

    Call it in every process, after ``amp8.initialize`` and after wrapping the model it
    returned in DDP, before the first forward. amp8 then averages the FP8 weights'
    gradients over DDP's process group (paused inside ``ddp.no_sync()``; under
    ``find_unused_parameters=True`` when each backward ends), and DDP every other
    gradient. Calling it again with the same DDP does nothing.

    Args:
        ddp: the ``DistributedDataParallel`` whose ``module`` is the model
            ``amp8.initialize`` returned (at O1 or O2).
        optimizer: the optimizer ``amp8.initialize`` returned; needed only where amp8
            kept no layer of the model in FP8 (then it finds its process group there).
        comm_hook: register ``amp8.distributed.fp8_compress_hook`` on the DDP, so the
            other gradients travel in FP8 as well. False leaves DDP's reduction as it is:
            its own all-reduce, or the comm hook you registered (DDP takes one).

    A model amp8 does not reduce (O0, ``FP8_COMPUTE_ONLY``, one process) is left to DDP
    and ``ddp`` is returned unchanged.

    Raises:
        TypeError: ``ddp`` is not a ``DistributedDataParallel``, or ``optimizer`` is not
            one ``amp8.initialize`` returned in a process group.
        RuntimeError: the model's FP8 weights are sharded (O3 brings FSDP2); the model is a
            copy (``copy.deepcopy``) of the one ``initialize`` returned, whose gradients
            no optimizer averages; DDP does not leave the FP8 weights to amp8 (it was
            built before ``initialize``, or around another module); ``comm_hook=True``
            and the DDP has a comm hook already.
    """
    if not isinstance(ddp, DDP):
        raise TypeError(
            f"amp8.distributed.register_ddp takes a torch.nn.parallel.DistributedDataParallel, got "
            f"{type(ddp).__name__}; wrap the model amp8.initialize returned first: "
            "register_ddp(DistributedDataParallel(model))"
        )
    data_parallel, sharded = _amp8_group(ddp.module, optimizer)
    if _is_copy(ddp.module):
        raise RuntimeError(_SHARDED_MESSAGE if sharded else _COPY_MESSAGE)
    if data_parallel is None:
        return ddp
    if sharded:
        raise RuntimeError(_SHARDED_MESSAGE)
    if data_parallel.ddp is ddp:
        return ddp
    _check_left_to_amp8(ddp)
    if comm_hook:
        _register_comm_hook(ddp, data_parallel)
    data_parallel.group = ddp.process_group
    data_parallel.ddp = ddp
    watch = DdpWatch(data_parallel)
    ddp.register_forward_pre_hook(watch.before_forward)
    ddp.register_forward_hook(watch.after_forward)
    return ddp


def register_ddp_when_wrapped(module: nn.Module, *, comm_hook: bool = True) -> nn.Module:
    """Have the ``DistributedDataParallel`` that a trainer builds around ``module``
    registered with amp8 at its first forward, as ``register_ddp`` would; returns ``module``.

    For trainers that wrap the model in DDP themselves (Hugging Face ``Trainer``,
    Lightning): call it in every process after ``amp8.initialize``, on the module the
    trainer wraps, the model ``initialize`` returned or a module holding it (a
    ``LightningModule``). amp8's FP8 weights and buffers join that module's DDP ignore
    list, and the first forward with grad that a DDP runs (eagerly; see the module
    docstring) registers it. Nothing happens where amp8 reduces nothing (O0,
    ``FP8_COMPUTE_ONLY``, one process).

    Args:
        module: the module the trainer will wrap in DDP.
        comm_hook: as for ``register_ddp``: register ``fp8_compress_hook`` on the DDP.

    Raises:
        RuntimeError: the model's FP8 weights are sharded (O3 brings FSDP2), or the model
            is a copy (``copy.deepcopy``) of the one ``initialize`` returned.
    """
    guards = _guards(module)
    for guard in guards:
        if guard.sharded:
            raise RuntimeError(_SHARDED_MESSAGE)
        if guard.data_parallel is None:
            raise RuntimeError(_COPY_MESSAGE)
        guard.register_with_comm_hook = comm_hook
    if guards:
        leave_to_amp8(module)
    return module


def _amp8_handles(model: nn.Module) -> list[StoredWeight]:
    """The stored-weight handles of ``model``'s FP8 layers and low-bit embeddings."""
    return [handle for param in model.parameters() if (handle := stored_weight(param)) is not None]


def _amp8_group(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[DataParallelGroup | None, bool]:
    """``(the data-parallel group amp8 averages model's gradients over, whether its FP8
    weights are sharded)``; ``(None, False)`` for a model amp8 does not reduce."""
    handles = _amp8_handles(model)
    sharded = any(handle.sharded for handle in handles)
    if optimizer is not None:
        reduction = getattr(optimizer, "gradient_average", None)
        if not isinstance(reduction, GradientReduction):
            raise TypeError(
                "register_ddp(ddp, optimizer): optimizer must be the one amp8.initialize returned in a "
                f"process group of more than one rank, got {type(optimizer).__name__}"
            )
        return reduction.data_parallel, sharded
    # Without the optimizer, the group is found for a model with FP8 weights only, as the
    # guard's message says (register_ddp's docstring).
    return (data_parallel_group(model) if handles else None), sharded


def data_parallel_group(model: nn.Module) -> DataParallelGroup | None:
    """The data-parallel group ``amp8.initialize`` set up for ``model`` (or for a module
    inside it): the ranks its optimizer averages gradients over, whose byte counter
    (``stats``) counts what amp8 sends. None where amp8 averages nothing (one process,
    O0, ``FP8_COMPUTE_ONLY``).

    The group is the one ``initialize`` gave the model's ``DdpGuard``, found among the
    model's forward pre-hooks: the model carries no other record of it, and amp8 keeps no
    table of models. A copy of the model (``copy.deepcopy``) has none."""
    return next((guard.data_parallel for guard in _guards(model) if guard.data_parallel is not None), None)


def _guards(model: nn.Module) -> list["DdpGuard"]:
    """The ``DdpGuard``s among the forward pre-hooks of ``model`` and the modules in it."""
    return [owner for module in model.modules() for owner in forward_pre_hook_owners(module)
            if isinstance(owner, DdpGuard)]


def _is_copy(model: nn.Module) -> bool:
    """Whether ``model`` is a copy of an amp8 model in a process group: it has guards, and
    none holds a group (see ``DdpGuard.__deepcopy__``)."""
    guards = _guards(model)
    return bool(guards) and all(guard.data_parallel is None for guard in guards)


def _check_left_to_amp8(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Raise unless DDP leaves every FP8 weight and buffer of its module to amp8."""
    ignored = set(ddp.parameters_to_ignore)
    missing = [name for name in amp8_names(ddp.module) if name not in ignored]
    if missing:
        raise RuntimeError(
            f"DistributedDataParallel wraps an amp8 model but does not leave {missing[0]!r} to amp8; "
            "call amp8.initialize in every process before wrapping, wrap the model it returned "
            "itself (DDP reads what to leave alone from that module when it is built), and do not "
            "replace the model's _ddp_params_and_buffers_to_ignore"
        )


def _register_comm_hook(ddp: nn.parallel.DistributedDataParallel, data_parallel: DataParallelGroup) -> None:
    """Register ``fp8_compress_hook`` on ``ddp``, or explain why DDP refused it."""
    try:
        ddp.register_comm_hook(data_parallel, fp8_compress_hook)
    except RuntimeError as error:
        raise RuntimeError(
            f"register_ddp could not register amp8's FP8 comm hook on this DistributedDataParallel "
            f"({error}); DDP takes one comm hook: to keep yours, call "
            "amp8.distributed.register_ddp(ddp, comm_hook=False) (amp8 then averages the FP8 "
            "weights' gradients, your hook the rest)"
        ) from error


def amp8_names(model: nn.Module) -> list[str]:
    """The names of the FP8 layers' weights and buffers in ``model``: what DDP must leave
    to amp8."""
    names = []
    for prefix, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and stored_weight(weight) is not None:
            dotted = prefix + "." if prefix else ""
            names.append(dotted + "weight")
            names.extend(dotted + name for name, _ in module.named_buffers(recurse=False))
    return names


def leave_to_amp8(model: nn.Module) -> None:
    """Tell a ``DistributedDataParallel`` built later around ``model`` to leave amp8's
    weights and buffers alone: DDP's ignore list, kept with any names the user listed."""
    names = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    names += [name for name in amp8_names(model) if name not in names]
    model._ddp_params_and_buffers_to_ignore = names


def running_ddp(module: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` whose forward is running ``module`` (as its module
    or inside it), found on the Python call stack; None when there is none."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is _DDP_FORWARD:
                ddp = frame.f_locals.get("self")
                if isinstance(ddp, DDP) and (ddp.module is module or _contains(ddp.module, module)):
                    return ddp
            frame = frame.f_back
        return None
    finally:
        del frame


def _contains(root: nn.Module, module: nn.Module) -> bool:
    return any(inner is module for inner in root.modules())


class DdpGuard:
    """The forward pre-hook ``initialize`` registers on a model in a process group: it
    refuses a DDP that runs the model without ``register_ddp``, and any DDP around a model
    whose FP8 weights FSDP2 shards (``sharded``, O3). See the module docstring.

    A copy of the model (``copy.deepcopy``: an EMA or evaluation copy) gets a guard of
    its own with no ``data_parallel`` (None): the copy holds no process group, and no
    optimizer averages its gradients, so its guard refuses any DDP that trains it."""

    def __init__(self, data_parallel: DataParallelGroup | None, sharded: bool) -> None:
        self.data_parallel = data_parallel
        self.sharded = sharded
        # None: refuse an unregistered DDP; a bool: register it (register_ddp_when_wrapped)
        # with that comm_hook.
        self.register_with_comm_hook: bool | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> "DdpGuard":
        """The guard of a copy of the model: no process group, no DDP (see the class)."""
        return DdpGuard(None, self.sharded)

    def before_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: raise if an unregistered DDP (or any DDP at O3, or any DDP
        around a copy of the model) runs ``module``."""
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        ddp = running_ddp(module)
        if ddp is None or (self.data_parallel is not None and ddp is self.data_parallel.ddp):
            return
        if self.sharded:
            raise RuntimeError(_SHARDED_MESSAGE)
        if self.data_parallel is None:
            raise RuntimeError(_COPY_MESSAGE)
        if self.register_with_comm_hook is not None:
            register_ddp(ddp, comm_hook=self.register_with_comm_hook)
            # The DDP's own forward pre-hooks ran before this forward registered them.
            self.data_parallel.backward_sync = bool(ddp.require_backward_grad_sync)
            return
        fix = "amp8.distributed.register_ddp(ddp)" if _amp8_handles(module) else "amp8.distributed.register_ddp(ddp, optimizer)"
        raise RuntimeError(
            "a DistributedDataParallel runs this amp8 model but was not registered with amp8: "
            f"call {fix} in every process after wrapping the model, before its first forward "
            "(amp8 averages the FP8 weights' gradients over DDP's group, pauses inside no_sync(), "
            "and registers its FP8 comm hook; comm_hook=False keeps DDP's own reduction)"
        )


def guard_ddp(model: nn.Module, data_parallel: DataParallelGroup, *, sharded: bool = False) -> DdpGuard:
    """Register ``DdpGuard``'s pre-hook on ``model``; returns the guard."""
    guard = DdpGuard(data_parallel, sharded)
    model.register_forward_pre_hook(guard.before_forward)
    return guard


def stop_watching(model: nn.Module, names: list[str]) -> None:
    """Remove amp8's DDP guard from ``model``, and ``names`` (``amp8_names`` of the amp8
    model it copies: see ``amp8.export``) from what DDP ignores: a DDP built around it
    later treats it as any model."""
    remove_forward_hooks(model, lambda owner: isinstance(owner, DdpGuard))
    ignored = getattr(model, "_ddp_params_and_buffers_to_ignore", None)
    if ignored is not None:
        removed = set(names)
        model._ddp_params_and_buffers_to_ignore = [name for name in ignored if name not in removed]
