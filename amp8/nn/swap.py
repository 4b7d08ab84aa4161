"""Explicit, filterable replacement of GEMM layers (``nn.Linear``, its subclasses with
Linear's math, ``Conv1D``-like layers: ``amp8.nn.gemm_layers``) and experts modules by FP8
ones (and of embeddings by low-bit ones).

Nothing in torch is patched: the swap walks the model's children and re-binds the
attributes of the parent modules that held eligible modules.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Callable

from torch import nn

from amp8.nn.adapters import adapted_embeddings, adapter_modules
from amp8.nn.experts import Fp8Experts
from amp8.nn.experts_layout import experts_layout, experts_reason, routers
from amp8.nn.linear import Fp8Linear
from amp8.nn.gemm_layers import attention_out_projections, gemm_features, gemm_kind, math_reason
from amp8.nn.selection import LayerSelection, SpeedRule, resolve_selection
from amp8.quant.scale_layout import GEMM_ALIGNMENT

ModuleFilter = Callable[[nn.Module, str], bool]
"""``fn(module, fqn) -> bool``: True to run the layer named ``fqn`` in FP8."""



def shared_weight_names(model: nn.Module) -> dict[int, list[str]]:
    """For each Parameter held under more than one name, ``id(param) -> names``."""
    names: dict[int, list[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            names.setdefault(id(param), []).append(full)
    return {key: value for key, value in names.items() if len(value) > 1}


def high_precision_reason(linear: nn.Module, shared: dict[int, list[str]]) -> str | None:
    """Why the GEMM layer ``linear`` (an ``nn.Linear`` or ``Conv1D``-like) cannot run in
    FP8, or None if it can.

    FP8 GEMMs need in_features and out_features to be multiples of 16, and the weight
    must belong to this layer alone (FP8 layers re-store it, a tied user would see that).
    """
    reasons = []
    in_features, out_features = gemm_features(linear)
    if in_features % GEMM_ALIGNMENT:
        reasons.append(f"in_features={in_features} is not a multiple of {GEMM_ALIGNMENT}")
    if out_features % GEMM_ALIGNMENT:
        reasons.append(f"out_features={out_features} is not a multiple of {GEMM_ALIGNMENT}")
    names = shared.get(id(linear.weight))
    if names:
        reasons.append(f"weight is shared ({', '.join(names)})")
    return "; ".join(reasons) or None


def output_heads(model: nn.Module) -> dict[int, str]:
    """The model's output head, found by structure: ``{id(linear): why it is one}``.

    An output head is the ``nn.Linear`` that maps hidden states to the vocabulary's
    logits: what ``model.get_output_embeddings()`` returns (the method ``transformers``
    models have), else the last Linear, in module order, whose weight has the shape of
    the vocabulary's table (the embedding with the most rows: ``num_embeddings`` x
    ``embedding_dim``), the untied twin of the input embedding. Names play no part, so
    a renamed head is still found; a model without an embedding has none, nor has one
    whose ``get_output_embeddings()`` returns None (a BERT classifier's FFN may have the
    vocabulary table's shape). A model without a vocabulary head may have a
    classification head (``classification_head``).
    """
    getter = getattr(model, "get_output_embeddings", None)
    found = getter() if callable(getter) else None
    if isinstance(found, nn.Linear):
        return {id(found): "the model's get_output_embeddings()"}
    if callable(getter):  # the model says it has no vocabulary head: a layer of that shape is another
        return classification_head(model)
    return _vocabulary_head(model) or classification_head(model)


def classification_head(model: nn.Module) -> dict[int, str]:
    """The model's classification head: ``{id(layer): why it is one}``, or ``{}``.

    The last GEMM layer in module order (``amp8.nn.gemm_layers.gemm_kind``) where its
    out_features equal ``model.config.num_labels`` (what ``transformers``' sequence,
    token and image classifiers and question-answering models hold): ``score``,
    ``classifier``, ``qa_outputs``, a RoBERTa head's ``out_proj``, found without their
    names. Its logits feed the loss directly, as a vocabulary head's do, and FP8 buys
    nothing there (docs/levels.md; ``studies/classifier_head.py``).
    """
    labels = getattr(getattr(model, "config", None), "num_labels", None)
    if not isinstance(labels, int) or isinstance(labels, bool):
        return {}
    last = None
    for module in model.modules():
        if gemm_kind(module) is not None or isinstance(module, Fp8Linear):  # the report looks after the swap
            last = module
    if last is None or _out_features(last) != labels:
        return {}
    return {id(last): f"classification head: the last GEMM layer, with model.config.num_labels={labels} outputs"}


def _vocabulary_head(model: nn.Module) -> dict[int, str]:
    """The untied head of the vocabulary's table (see ``output_heads``), or ``{}``."""
    tables = [  # nn.Embedding, and the low-bit tables amp8 puts in their place
        (m.num_embeddings, m.embedding_dim, fqn) for fqn, m in model.named_modules()
        if isinstance(getattr(m, "num_embeddings", None), int) and isinstance(getattr(m, "embedding_dim", None), int)
    ]
    if not tables:
        return {}
    rows, width, table = max(tables, key=lambda entry: entry[0])
    shaped = [m for m in model.modules() if isinstance(m, nn.Linear) and tuple(m.weight.shape) == (rows, width)]
    if not shaped:
        return {}
    return {id(shaped[-1]): f"maps the width to the vocabulary of embedding {table!r}"}


def output_head_reason(linear: nn.Linear, heads: dict[int, str]) -> str | None:
    """Why ``Recipe.output_head="high"`` keeps ``linear`` in high precision, or None
    when it is not one of ``heads`` (see ``output_heads``)."""
    why = heads.get(id(linear))
    if why is None:
        return None
    return f"output head ({why}), kept by Recipe.output_head='high'; output_head='fp8' runs it in FP8"


def _out_features(layer: nn.Module) -> int:
    features = getattr(layer, "out_features", None)
    return features if isinstance(features, int) else gemm_features(layer)[1]


def recipe_pattern_reason(fqn: str, high_precision_layers: tuple[str, ...]) -> str | None:
    """Why ``Recipe.high_precision_layers`` keeps the layer named ``fqn`` out of FP8 (its
    first matching ``fnmatch`` pattern), or None."""
    matched = [pattern for pattern in high_precision_layers if fnmatchcase(fqn, pattern)]
    return f"matches Recipe.high_precision_layers pattern {matched[0]!r}" if matched else None


@dataclass(frozen=True)
class ModelFacts:
    """What the reasons for keeping a GEMM layer in high precision need to know of the
    whole model, each ``{id(module): why}`` (shared weights: ``{id(weight): names}``)."""

    shared: dict[int, list[str]]
    heads: dict[int, str]
    routing: dict[int, str]
    adapters: dict[int, str]
    attention: dict[int, str]

    @classmethod
    def of(cls, model: nn.Module, keep_output_heads: bool) -> "ModelFacts":
        """The facts of ``model``; output heads only where they are kept (``keep_output_heads``)."""
        return cls(
            shared=shared_weight_names(model),
            heads=output_heads(model) if keep_output_heads else {},
            routing=routers(model),
            adapters=adapter_modules(model),
            attention=attention_out_projections(model),
        )


def gemm_layer_reason(
    layer: nn.Module,
    fqn: str,
    facts: ModelFacts,
    rule: SpeedRule | None,
    module_filter: ModuleFilter | None = None,
    high_precision_layers: tuple[str, ...] = (),
) -> str | None:
    """Why the GEMM layer ``layer`` named ``fqn`` stays in high precision, or None to run
    it in FP8: the first of what the layer cannot do (read directly by its attention,
    shapes, a shared weight, a router, a PEFT adapter, math other than its kind's), the
    speed ``rule``, the ``module_filter``, an output head ``facts`` keeps, and a pattern
    of ``high_precision_layers``."""
    key = id(layer)
    found = (
        facts.attention.get(key) or high_precision_reason(layer, facts.shared) or facts.routing.get(key)
        or facts.adapters.get(key) or math_reason(layer)
    )
    if found is None and rule is not None:
        found = rule.reason(layer)
    if found is None and module_filter is not None and not module_filter(layer, fqn):
        found = "excluded by module_filter"
    return found or output_head_reason(layer, facts.heads) or recipe_pattern_reason(fqn, high_precision_layers)


def swap_linear_layers(
    model: nn.Module,
    make_fp8: Callable[[nn.Module], nn.Module],
    module_filter: ModuleFilter | None = None,
    layer_selection: LayerSelection = "all",
    high_precision_layers: tuple[str, ...] = (),
    keep_output_heads: bool = False,
) -> dict[str, str]:
    """Replace eligible GEMM layers of ``model`` (``nn.Linear``, its subclasses, and
    ``Conv1D``-like layers: ``amp8.nn.gemm_layers.gemm_kind``) by ``make_fp8(layer)``
    (``Fp8Linear.from_module`` builds the right one of each kind).

    Children are visited before their parents and every candidate is passed to
    ``module_filter(module, fqn)`` with its full dotted name. A layer FP8 cannot run
    (see ``high_precision_reason``) is never swapped, whatever the filter says, nor is an
    adapter of a PEFT layer (LoRA's ``lora_A``, ``lora_B``: ``amp8.nn.adapters``); nor is
    one that the speed rule of ``layer_selection`` (for the device the layer's weight is
    on, see ``amp8.nn.selection``) finds too small to gain from FP8, nor one whose name
    matches an ``fnmatch`` pattern of ``high_precision_layers`` (``Recipe``'s), nor,
    with ``keep_output_heads``, the model's output head (see ``output_heads``), nor a
    layer whose forward computes other math than its kind's, nor ``nn.MultiheadAttention``'s
    ``out_proj`` (see ``amp8.nn.gemm_layers``).

    Returns:
        ``{fqn: reason}`` for every GEMM layer left in high precision.
    """
    if isinstance(model, nn.Linear):
        raise TypeError(
            "amp8 swaps layers inside a model; got a bare nn.Linear. Wrap it, e.g. "
            "nn.Sequential(linear), and pass that"
        )
    facts = ModelFacts.of(model, keep_output_heads)

    def reason(layer: nn.Module, fqn: str) -> str | None:
        rule = resolve_selection(layer_selection, layer.weight.device.type)  # type: ignore[union-attr]
        return gemm_layer_reason(layer, fqn, facts, rule, module_filter, high_precision_layers)

    return _swap_children(model, lambda child: gemm_kind(child) is not None, reason, make_fp8)


def swap_experts(
    model: nn.Module,
    make_fp8: Callable[[nn.Module], nn.Module],
    module_filter: ModuleFilter | None = None,
    high_precision_layers: tuple[str, ...] = (),
) -> dict[str, str]:
    """Replace the experts modules of ``model`` (found by structure, see
    ``amp8.nn.experts_layout``) by ``make_fp8(experts)``, children before parents.

    As for ``swap_linear_layers``, ``module_filter(module, fqn)`` (called with the experts
    module) and the patterns of ``high_precision_layers`` may keep one in high precision;
    the speed rules of layer selection do not apply (they are measured on dense layers).
    One amp8 cannot run in FP8 (``experts_reason``) is kept too, with a warning that names
    it and why, unless the filter or a pattern keeps it anyway.

    Returns:
        ``{fqn: reason}`` for every experts module left in high precision.
    """
    shared = shared_weight_names(model)

    def reason(experts: nn.Module, fqn: str) -> str | None:
        if module_filter is not None and not module_filter(experts, fqn):
            return "excluded by module_filter"
        found = recipe_pattern_reason(fqn, high_precision_layers)
        if found is None:
            found = experts_reason(experts, experts_layout(experts), shared)  # type: ignore[arg-type]
            if found is not None:  # the user asked for FP8 here: say why it cannot be
                warnings.warn(
                    f"amp8: the experts {fqn!r} ({type(experts).__name__}) stay in high precision: {found}. "
                    "amp8.nn.ExpertsLayout documents what amp8 runs in FP8",
                    stacklevel=2,
                )
        return found

    def is_experts(child: nn.Module) -> bool:
        return not isinstance(child, Fp8Experts) and experts_layout(child) is not None

    return _swap_children(model, is_experts, reason, make_fp8)


def embedding_reason(embedding: nn.Embedding, shared: dict[int, list[str]]) -> str | None:
    """Why amp8 keeps ``embedding``'s table as the model has it, or None if it can store
    it at the level's bytes (``LowBitEmbedding``): options that renormalize the table in
    forward (``max_norm``), scale or sparsify its gradient, or a table another module
    shares (a tied output head reads it whole, in its own dtype)."""
    reasons = []
    if embedding.max_norm is not None:
        reasons.append(f"max_norm={embedding.max_norm} renormalizes the table in place during forward")
    if embedding.scale_grad_by_freq:
        reasons.append("scale_grad_by_freq=True")
    if embedding.sparse:
        reasons.append("sparse=True (a sparse gradient)")
    names = shared.get(id(embedding.weight))
    if names:
        reasons.append(f"weight is shared ({', '.join(names)})")
    return "; ".join(reasons) or None


def swap_embeddings(model: nn.Module, make_low_bit: Callable[[nn.Embedding], nn.Module]) -> dict[str, str]:
    """Replace ``nn.Embedding`` children of ``model`` that ``embedding_reason`` allows, and
    that no PEFT layer adapts (``amp8.nn.adapters.adapted_embeddings``), by
    ``make_low_bit(embedding)``.

    Returns:
        ``{fqn: reason}`` for every ``nn.Embedding`` left as it is.
    """
    shared = shared_weight_names(model)
    adapted = adapted_embeddings(model)
    return _swap_children(
        model, lambda child: type(child) is nn.Embedding,
        lambda embedding, fqn: embedding_reason(embedding, shared) or adapted.get(id(embedding)), make_low_bit,
    )


def _swap_children(
    model: nn.Module,
    matches: Callable[[nn.Module], bool],
    reason: Callable[[Any, str], str | None],
    make: Callable[[Any], nn.Module],
) -> dict[str, str]:
    """Replace every child that ``matches`` (children before parents) for which
    ``reason(child, fqn)`` is None by ``make(child)``; ``{fqn: reason}`` of the others."""
    kept: dict[str, str] = {}

    def visit(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent.named_children()):
            fqn = f"{prefix}.{child_name}" if prefix else child_name
            visit(child, fqn)
            if not matches(child):
                continue
            found = reason(child, fqn)
            if found is None:
                setattr(parent, child_name, make(child))
            else:
                kept[fqn] = found

    visit(model, "")
    return kept
