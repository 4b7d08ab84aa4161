"""``initialize``: wire an opt level into a model and its optimizer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from amp8._compat import fsdp_module_types
from amp8.config.levels import OptLevel, Precision, resolve_level
from amp8.config.recipe import ActivationFormat, Granularity, Microscaling, OutputHead, Recipe
from amp8.distributed.agreement import check_ranks_agree
from amp8.distributed.data_parallel import DataParallelGroup, broadcast_module, process_group_size
from amp8.distributed.ddp import guard_ddp, leave_to_amp8
from amp8.distributed.reduction import GradientReduction
from amp8.monitor.controller import Controller
from amp8.nn.activations import attach_activation_storage
from amp8.nn.embedding import LowBitEmbedding
from amp8.nn.experts import Fp8Experts
from amp8.nn.linear import Fp8Linear
from amp8.nn.selection import LayerSelection, resolve_selection
from amp8.nn.stored_module import StoredWeightModule
from amp8.nn.swap import ModuleFilter, swap_embeddings, swap_experts, swap_linear_layers
from amp8.ops.gemm import check_fp8_device
from amp8.optim.adam import LowBitAdam
from amp8.optim.support import check_state_precision, check_supported


def _wrapped(model: nn.Module) -> str | None:
    """The name of the first module (``""``: the model) that DDP, DataParallel or FSDP
    already wraps, else None."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel, *fsdp_module_types())
    return next((name for name, module in model.named_modules() if isinstance(module, wrappers)), None)


def fp8_layers(model: nn.Module) -> dict[nn.Parameter, Fp8Linear]:
    """``{weight Parameter: layer}`` for every ``Fp8Linear`` in ``model``."""
    return {module.weight: module for module in model.modules() if isinstance(module, Fp8Linear)}


def _check_call(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    opt_level: str | OptLevel,
    recipe: Recipe | None,
    layer_selection: LayerSelection,
    distributed: bool = False,
) -> tuple[OptLevel, Recipe]:
    """The opt level and recipe of an ``initialize`` call, after every check that needs no
    other rank; raises what ``initialize`` documents."""
    level = resolve_level(opt_level)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if recipe is None:
        recipe = default_recipe(level, distributed)
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an amp8.Recipe, got {type(recipe).__name__}")
    if not level.swaps_layers:
        return level, recipe
    wrapped = _wrapped(model)
    if wrapped is not None:
        where = "model" if wrapped == "" else f"model.{wrapped}"
        raise TypeError(
            f"{where} is wrapped in {type(model.get_submodule(wrapped)).__name__}; call "
            "amp8.initialize on the bare model, before any DDP or fully_shard: in a process "
            "group it averages gradients in FP8 itself, and at O3 it applies fully_shard "
            "to the FP8 layers' weights itself"
        )
    for device_type in {param.device.type for param in model.parameters()}:
        resolve_selection(layer_selection, device_type)  # a wrong value fails before any change
    already = next(
        ((name, m) for name, m in model.named_modules() if isinstance(m, (StoredWeightModule, Fp8Experts))), None
    )
    if already is not None:
        raise ValueError(
            f"model is already initialized by amp8 (found {type(already[1]).__name__} at {already[0]!r}); "
            "call amp8.initialize once, on a model that has not been through it"
        )
    if optimizer is not None and level.takes_over_optimizer:
        check_supported(optimizer)
    for device in {param.device for param in model.parameters()}:
        check_fp8_device(device)
    if level.takes_over_optimizer:
        check_state_precision(level)
    return level, recipe


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    opt_level: str | OptLevel = "O1",
    recipe: Recipe | None = None,
    module_filter: ModuleFilter | None = None,
    process_group: dist.ProcessGroup | None = None,
    layer_selection: LayerSelection = "auto",
    controller: Controller | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Apply an opt level to ``model`` and ``optimizer``; returns ``(model, optimizer)``.

    At O1 and above, every ``nn.Linear`` whose features are multiples of 16, whose weight
    is its own, that ``module_filter(module, fqn)`` accepts (all, by default) and that
    ``layer_selection`` expects to be faster in FP8 becomes an ``Fp8Linear`` that reuses
    its Parameters (but a MoE router, which stays in high precision). Mixture-of-experts
    experts modules (transformers' ``MixtralExperts`` and the like, found by structure:
    ``amp8.nn.experts_layout``) that ``module_filter`` accepts become ``Fp8Experts`` (the
    speed rules, measured on dense layers, do not apply to them): their GEMMs run in FP8,
    their Parameters stay as parameters outside FP8 layers are stored; one amp8 cannot
    run stays as it is, with a warning. ``layer_selection="auto"`` applies the speed rule
    of the device the layer is on (``amp8.nn.selection.DEFAULT_RULES``: every layer on
    the CPU, where FP8 is emulated for its numerics; large enough layers on CUDA), ``"all"`` takes every
    eligible layer, and an ``amp8.nn.selection.SpeedRule`` (e.g. one measured with ``bench/linear.py
    --sweep``) applies that rule; the optimizer (``torch.optim.Adam`` or
    ``AdamW``) is replaced by a ``LowBitAdam`` with the same param groups. O0 returns
    both unchanged (unless ``recipe.activations`` is "fp8": at every level, a forward
    pre-hook and a forward hook on ``model`` then store the tensors autograd saves for
    backward in FP8, see ``amp8.nn.activations``), and ``amp8.config.levels.FP8_COMPUTE_ONLY`` ("O1-compute") swaps the layers
    but keeps weights, gradients and the optimizer as they are (any optimizer). Use the
    returned objects from here on, and build LR schedulers after this call.

    Data parallel: called in every process of a ``torch.distributed`` group of more than
    one rank (``process_group``, default the world), it copies rank 0's parameters and
    buffers to all ranks, and the returned optimizer averages every gradient over the
    ranks in FP8 before each step. At O1 and O2 the model may then be wrapped in
    ``DistributedDataParallel`` (apex's order) and the DDP handed to
    ``amp8.distributed.register_ddp``: DDP averages the other gradients, through
    ``amp8.distributed.fp8_compress_hook``, and amp8 the FP8 weights' (see
    ``amp8.distributed.ddp``); a DDP that runs the model unregistered fails at its first
    forward.
    At O3 it also applies FSDP2's ``fully_shard`` to every FP8 layer (for its weight) and
    to the model (for nothing, as FSDP2's root): each rank keeps its rows of the FP8
    weights, their master weights and moments, and FSDP2 all-gathers the FP8 weights
    around each layer's forward and backward. Pass the bare model: amp8 refuses a model
    that DDP or FSDP already wraps (O0 leaves the model to them).

    ``controller`` (an ``amp8.Controller``) watches the FP8 layers' casts and moves a
    layer's GEMMs to finer scales or high precision when they lose too much, and applies
    its precision schedule; it acts after each step of the returned optimizer (needed
    then) and is saved with its ``state_dict`` (see ``amp8.monitor.controller``).

    Raises:
        ValueError: unknown opt level (or an override amp8 cannot store), a model amp8
            already initialized, optimizer options amp8 does not support, ranks of a
            process group that differ in level, recipe or model (on every rank).
        TypeError: a model that is not an ``nn.Module``; an optimizer other than Adam/AdamW
            at a level that stores weights or gradients scaled (O1-O3).
        RuntimeError: a parameter on a device without FP8 support; in a process group,
            on every other rank when one rank fails any of these checks (O0 included), so
            no rank waits for it in a collective.
    """
    if controller is not None:
        _check_controller(controller, optimizer)
    model, optimizer = _initialize(model, optimizer, opt_level, recipe, module_filter, process_group, layer_selection)
    if controller is not None:
        controller.attach(model, optimizer, _decision_group(model, process_group))  # type: ignore[arg-type]
    return model, optimizer


def _check_controller(controller: Controller, optimizer: torch.optim.Optimizer | None) -> None:
    if not isinstance(controller, Controller):
        raise TypeError(f"controller must be an amp8.Controller, got {type(controller).__name__}")
    if controller.attached:
        raise RuntimeError("this amp8.Controller already watches a model; build one Controller per model")
    if optimizer is None:
        raise ValueError("amp8.initialize(controller=...) needs the optimizer: the controller acts after each step")


def _decision_group(model: nn.Module, process_group: dist.ProcessGroup | None) -> DataParallelGroup | None:
    """The data-parallel group whose ranks must take the same decisions: amp8's own
    where the layers have one, else one over ``process_group`` (None on one process)."""
    if process_group_size(process_group) <= 1:
        return None
    for module in model.modules():
        if isinstance(module, StoredWeightModule) and module.stored_weight.data_parallel is not None:
            return module.stored_weight.data_parallel
    return DataParallelGroup(process_group)


def _initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    opt_level: str | OptLevel,
    recipe: Recipe | None,
    module_filter: ModuleFilter | None,
    process_group: dist.ProcessGroup | None,
    layer_selection: LayerSelection,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """``initialize`` without the controller."""
    distributed = process_group_size(process_group) > 1
    level = checked_recipe = failure = None
    try:
        level, checked_recipe = _check_call(model, optimizer, opt_level, recipe, layer_selection, distributed)
    except (ValueError, TypeError, RuntimeError) as error:
        if not distributed:
            raise
        failure = error
    if distributed:  # before anything else goes over the wire: ranks that differ would hang
        check_ranks_agree(model, level, checked_recipe, process_group, failure)
    assert level is not None and checked_recipe is not None  # else the check above raised
    recipe = checked_recipe
    if recipe.activations is ActivationFormat.FP8:
        attach_activation_storage(model)
    if not level.swaps_layers:
        return model, optimizer
    if distributed and level.shard_optimizer and recipe.granularity is not Granularity.TENSORWISE:
        raise ValueError(
            f"opt level {level.name} shards its optimizer over data-parallel ranks, which "
            f"amp8 does for tensorwise scales only; got {_granularity_name(recipe)}. "
            "Use Recipe(granularity='tensorwise') or O2"
        )
    # Layers start with FP16 weights, so that O3's FP16 master weights are taken from
    # them before the weights themselves drop to FP8.
    first_storage = Precision.FP16 if level.weight is not Precision.AS_IS else Precision.AS_IS
    swap_linear_layers(
        model,
        lambda linear: Fp8Linear.from_linear(linear, recipe, first_storage),
        module_filter,
        layer_selection,
        recipe.high_precision_layers,
        keep_output_heads=recipe.output_head is OutputHead.HIGH,
    )
    # The experts' Parameters keep the storage of parameters outside FP8 layers: only
    # their GEMMs change.
    swap_experts(
        model, lambda experts: Fp8Experts.from_module(experts, recipe), module_filter, recipe.high_precision_layers
    )
    layers = fp8_layers(model)
    if not level.takes_over_optimizer:  # FP8 compute only: a plain model to everyone else
        return model, optimizer
    swap_embeddings(model, lambda embedding: LowBitEmbedding.from_embedding(embedding, recipe))
    data_parallel = None
    if distributed:
        broadcast_module(model, process_group)
        data_parallel = DataParallelGroup(process_group)
        for module in model.modules():
            if isinstance(module, StoredWeightModule):
                module.stored_weight.data_parallel = data_parallel
    master_weights = {}
    if level.weight is not Precision.FP16:
        if level.master_weight is not None:
            master_weights = {layer: layer.read_weight() for layer in layers.values()}
        for layer in layers.values():
            layer.set_weight_storage(level.weight)
    if distributed and level.shard_optimizer:
        from amp8.distributed.fsdp import shard_weights

        shard_weights(model, layers.values(), data_parallel)  # new weight Parameters
        for layer in layers.values():
            layer.mark_weight_sharded()
    if distributed:
        leave_to_amp8(model)
        guard_ddp(model, data_parallel, sharded=level.shard_optimizer)  # type: ignore[arg-type]
    if optimizer is None:
        return model, None
    replaced = {old: layer.weight for old, layer in layers.items()}
    reduction = None
    if data_parallel is not None:  # the optimizer's gradients, averaged over the ranks
        params = [replaced.get(p, p) for group in optimizer.param_groups for p in group["params"]]
        reduction = GradientReduction(data_parallel, params)
    return model, LowBitAdam.from_optimizer(
        optimizer, level, replaced=replaced, reduction=reduction,
        master_weights={layer.weight: real for layer, real in master_weights.items()},
    )


def default_recipe(level: OptLevel, distributed: bool = False) -> Recipe:
    """The recipe ``initialize`` uses when it is given none, chosen by the defaults study
    (``bench/numerics_ablation.py --configs realistic``): ``Recipe.preset("rowwise")``
    (E4M3, power-of-two scales, one per row) with the output head in high precision, at
    every level; ``Recipe()`` (one scale per tensor) for O3 in a process group
    (``distributed``), whose sharded optimizer amp8 builds for one scale per tensor only.
    """
    if distributed and level.shard_optimizer:
        return Recipe()
    return Recipe.preset("rowwise").replace(output_head=OutputHead.HIGH)


def _granularity_name(recipe: Recipe) -> str:
    """The recipe's scale granularity as an error message names it."""
    if recipe.microscaling is not Microscaling.NONE:
        return f"the {recipe.microscaling.value} format's {recipe.block_size}-element blocks"
    return f"granularity={recipe.granularity.value!r}"
