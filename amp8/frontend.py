"""``initialize``: wire an opt level into a model and its optimizer."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from amp8._compat import fsdp_module_types
from amp8.config.levels import OptLevel, Precision, resolve_level
from amp8.config.recipe import ActivationFormat, Granularity, Microscaling, OutputHead, Recipe
from amp8.distributed.agreement import check_ranks_agree
from amp8.distributed.data_parallel import DataParallelGroup, broadcast_module, process_group_size
from amp8.distributed.ddp import data_parallel_group, guard_ddp, leave_to_amp8
from amp8.distributed.reduction import GradientReduction
from amp8.monitor.controller import Controller
from amp8.nn.activations import attach_activation_storage
from amp8.nn.adapters import adopt_lora_layers, check_lora_layers
from amp8.nn.compiled_casts import set_compiled_casts
from amp8.nn.embedding import LowBitEmbedding
from amp8.nn.experts import Fp8Experts
from amp8.nn.gemm_share import GemmShare
from amp8.nn.linear import Fp8Linear
from amp8.nn.selection import LayerSelection, resolve_selection
from amp8.nn.single_weight import SingleStoredWeightModule
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
        ((name, m) for name, m in model.named_modules() if isinstance(m, (SingleStoredWeightModule, Fp8Experts))), None
    )
    if already is not None:
        raise ValueError(
            f"model is already initialized by amp8 (found {type(already[1]).__name__} at {already[0]!r}); "
            "call amp8.initialize once, on a model that has not been through it"
        )
    if level.weight is not Precision.AS_IS:
        check_lora_layers(model)
    if optimizer is not None and level.takes_over_optimizer:
        check_supported(optimizer)
    if optimizer is not None:
        _check_optimizer_trains(model, optimizer)
    for device in {param.device for param in model.parameters()}:
        check_fp8_device(device)
    if level.takes_over_optimizer:
        check_state_precision(level)
    return level, recipe


def _check_optimizer_trains(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that holds parameters but none of ``model``'s: it was built
    over another model (or a copy of this one), and would train that one."""
    own = {id(param) for param in model.parameters()}
    held = [param for group in optimizer.param_groups for param in group["params"]]
    if held and not any(id(param) in own for param in held):
        raise ValueError(
            f"the optimizer holds {len(held)} parameters and none of them is the model's: it was built "
            "over another model (or a copy of this one); build it over model.parameters() of the model "
            "passed to amp8.initialize"
        )


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    opt_level: str | OptLevel = "O1",
    recipe: Recipe | None = None,
    module_filter: ModuleFilter | None = None,
    process_group: dist.ProcessGroup | None = None,
    layer_selection: LayerSelection = "auto",
    controller: Controller | None = None,
    compiled_casts: bool | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Apply an opt level to ``model`` and ``optimizer``.

    Eligible GEMM layers (``nn.Linear``, its subclasses with Linear's math, GPT-2's
    ``Conv1D``: ``amp8.nn.gemm_layers``) become ``amp8.nn.Fp8Linear`` layers and
    mixture-of-experts experts modules (found by structure, ``amp8.nn.experts_layout``)
    ``amp8.nn.Fp8Experts``, each reusing its Parameters, and Adam/AdamW becomes
    ``amp8.optim.LowBitAdam`` with the same param groups (docs/levels.md). A level that
    runs no layer in FP8, or leaves more than half of the GEMM work in high precision,
    warns, naming the largest layers kept and why (``amp8.nn.gemm_share``). Use the returned objects from here on and build LR
    schedulers after this call. In a ``torch.distributed`` group, call it in every
    process with the bare model; at O1/O2 wrap the result in ``DistributedDataParallel``
    and pass that to ``amp8.distributed.register_ddp`` (docs/distributed.md).

    Args:
        model: the model; O0 returns it unchanged (but for FP8 activations).
        optimizer: ``torch.optim.Adam`` or ``AdamW`` (any optimizer at O0 and
            "O1-compute"), or None to convert the model alone.
        opt_level: "O0", "O1", "O2", "O3" or "O1-compute", or an ``OptLevel``.
        recipe: how tensors are scaled and cast; None takes the level's default
            (``amp8.frontend.default_recipe``; docs/recipes.md).
        module_filter: ``(module, fqn) -> bool``; a layer it refuses stays as it is.
        process_group: the data-parallel group (default: the world, when initialized
            with more than one rank); rank 0's parameters and buffers are copied to all,
            and an ``amp8.distributed.GradientReduction`` is attached to the returned
            optimizer (its ``gradient_average``) to average gradients in FP8.
        layer_selection: "auto" (the device's speed rule,
            ``amp8.nn.selection.DEFAULT_RULES``), "all", or an
            ``amp8.nn.selection.SpeedRule``.
        controller: an ``amp8.Controller`` that watches the FP8 layers' casts and moves
            layers to finer scales or high precision (docs/controller.md).
        compiled_casts: the FP8 layers' casts outside ``torch.compile`` run as amp8's
            compiled kernels (True: eager speed without compiling the model) or as
            eager operations (False); the same bits either way
            (``amp8.nn.set_compiled_casts``, docs/speed.md). None (default): compiled
            for a model on CUDA, eager elsewhere. Where a cast cannot be compiled, it runs
            eagerly with a warning.

    Returns:
        ``(model, optimizer)``: the same model with its layers swapped, and the
        optimizer to step (the one given at O0 and "O1-compute").

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
    if compiled_casts is not None and not isinstance(compiled_casts, bool):
        raise TypeError(f"compiled_casts={compiled_casts!r} is not valid; use True, False or None (compiled on CUDA)")
    if compiled_casts is None:
        compiled_casts = any(param.device.type == "cuda" for param in model.parameters())
    if compiled_casts:
        set_compiled_casts(model, True)
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
    """The data-parallel group whose ranks must take the same decisions: the one
    ``_initialize`` set up for the model, else one over ``process_group`` (None on one
    process)."""
    if process_group_size(process_group) <= 1:
        return None
    return data_parallel_group(model) or DataParallelGroup(process_group)


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
    kept = swap_linear_layers(
        model,
        lambda layer: Fp8Linear.from_module(layer, recipe, first_storage),
        module_filter,
        layer_selection,
        recipe.high_precision_layers,
        keep_output_heads=recipe.output_head is OutputHead.HIGH,
    )
    adopt_lora_layers(model)  # PEFT's LoRA layers over the new FP8 bases: merging is refused, with the fix
    kept |= swap_experts(
        model, lambda experts: Fp8Experts.from_module(experts, recipe, first_storage), module_filter,
        recipe.high_precision_layers,
    )
    message = GemmShare.of(model, kept).warning(level.name)
    if message is not None:
        warnings.warn(message, stacklevel=3)
    layers = fp8_layers(model)
    if not level.takes_over_optimizer:  # FP8 compute only: a plain model to everyone else
        return model, optimizer
    stored_experts = [
        module for module in model.modules()
        if isinstance(module, Fp8Experts) and module.weight_storage is not Precision.AS_IS
    ]
    swap_embeddings(model, lambda embedding: LowBitEmbedding.from_embedding(embedding, recipe))
    data_parallel = None
    if distributed:
        broadcast_module(model, process_group)
        data_parallel = DataParallelGroup(process_group)
    master_weights = {}
    expert_masters = {}
    if level.weight is not Precision.FP16:
        if level.master_weight is not None:
            master_weights = {layer: layer.read_weight() for layer in layers.values() if layer.weight.requires_grad}
            expert_masters = {
                handle.param: handle.read() for experts in stored_experts
                for handle in experts.stored_weights() if handle.param.requires_grad
            }
        for layer in [*layers.values(), *stored_experts]:
            layer.set_weight_storage(level.weight)
    replaced_experts: dict[nn.Parameter, nn.Parameter] = {}
    if distributed and level.shard_optimizer:
        from amp8.distributed.fsdp import shard_weights

        unsharded = {handle: handle.param for experts in stored_experts for handle in experts.stored_weights()}
        shard_weights(model, [*layers.values(), *stored_experts], data_parallel)  # new weight Parameters
        replaced_experts = {param: handle.param for handle, param in unsharded.items()}
        # Each rank keeps the master weights of its rows.
        master_weights = {layer: _own_rows(real, data_parallel) for layer, real in master_weights.items()}
        expert_masters = {replaced_experts[p]: _own_rows(real, data_parallel) for p, real in expert_masters.items()}
    if distributed:
        leave_to_amp8(model)
        guard_ddp(model, data_parallel, sharded=level.shard_optimizer)  # type: ignore[arg-type]
    if optimizer is None:
        return model, None
    low_bit = LowBitAdam.from_optimizer(
        optimizer, level, replaced={**{old: layer.weight for old, layer in layers.items()}, **replaced_experts},
        master_weights={**{layer.weight: real for layer, real in master_weights.items()}, **expert_masters},
    )
    if data_parallel is not None:  # the optimizer's gradients, averaged over the ranks
        GradientReduction.attach(low_bit, data_parallel)
    return model, low_bit


def _own_rows(real: torch.Tensor, data_parallel: DataParallelGroup) -> torch.Tensor:
    """This rank's rows of a whole weight ``real``, flat: the master weight it keeps of a
    weight FSDP2 shards."""
    return real.flatten()[slice(*data_parallel.shard_range(real.shape))]


def default_recipe(level: OptLevel, distributed: bool = False) -> Recipe:
    """The recipe ``initialize`` uses when it is given none, chosen by the defaults study
    (``studies/numerics_ablation.py --configs realistic``): ``Recipe.preset("rowwise")``
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
