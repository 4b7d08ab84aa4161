"""What ``amp8.initialize`` does with no recipe: one scale per row, the output head in
high precision (found by structure), at every level; tensorwise where the optimizer is
sharded."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import amp8
from amp8.config.levels import resolve_level
from amp8.frontend import default_recipe
from amp8.nn import Fp8Linear
from amp8.nn.swap import output_heads
from amp8.tools.experiments.gpt import PRESETS
from amp8.tools.experiments.llama import LlamaSpec, transformers_available

RECIPE_DEFAULT = amp8.Recipe.preset("rowwise").replace(output_head="high")
needs_transformers = pytest.mark.skipif(not transformers_available(), reason="needs transformers")


class LanguageModel(nn.Module):
    """An embedding, a block, and an untied head under a name that says nothing."""

    def __init__(self, vocab: int = 96, width: int = 32) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.readout = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.readout(self.block(self.table(idx)))


class WithOutputEmbeddings(nn.Module):
    """A model that names its head the way transformers models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.out = nn.Linear(32, 48)

    def get_output_embeddings(self) -> nn.Module:
        return self.out


def _untied_gpt() -> nn.Module:
    return dataclasses.replace(PRESETS["tiny"], tie_head=False).build(torch.Generator().manual_seed(0))


@pytest.mark.parametrize("level", ["O1", amp8.config.levels.FP8_COMPUTE_ONLY, "O2", "O3"])
def test_no_recipe_means_rowwise_with_the_head_in_high_precision(level: str) -> None:
    model = _untied_gpt()
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), level)
    assert type(model.head) is nn.Linear, "the untied head must stay in high precision"
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.recipe == RECIPE_DEFAULT for m in layers)
    assert all(m.gemm_granularity is amp8.config.Granularity.ROWWISE for m in layers)
    notes = {row.name: row.note for row in amp8.report(model, optimizer).rows}
    assert notes["head.weight"].startswith("output head (maps the width to the vocabulary of embedding 'tok_emb')")


@pytest.mark.parametrize("recipe", [amp8.Recipe(), amp8.Recipe.preset("rowwise"), RECIPE_DEFAULT.replace(output_head="fp8")])
def test_output_head_fp8_runs_the_head_in_fp8(recipe: amp8.Recipe) -> None:
    model = _untied_gpt()
    model, _ = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1", recipe=recipe)
    assert isinstance(model.head, Fp8Linear)


def test_an_explicit_recipe_is_used_as_given() -> None:
    model = _untied_gpt()
    recipe = amp8.Recipe(output_head="high")
    model, _ = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1", recipe=recipe)
    granularities = {m.gemm_granularity for m in model.modules() if isinstance(m, Fp8Linear)}
    assert granularities == {amp8.config.Granularity.TENSORWISE}
    assert type(model.head) is nn.Linear


def test_tied_head_is_kept_for_its_shared_weight_not_as_a_head() -> None:
    model = PRESETS["tiny"].build(torch.Generator().manual_seed(0))
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1")
    assert type(model.head) is nn.Linear
    notes = {row.name: row.note for row in amp8.report(model, optimizer).rows}
    assert notes["tok_emb.weight"].startswith("weight is shared")


def test_head_is_found_by_structure_not_by_name() -> None:
    model = LanguageModel()
    assert set(output_heads(model)) == {id(model.readout)}
    model, _ = amp8.initialize(model, None, "O1")
    assert type(model.readout) is nn.Linear
    assert isinstance(model.block[0], Fp8Linear) and isinstance(model.block[2], Fp8Linear)


def test_get_output_embeddings_names_the_head() -> None:
    model = WithOutputEmbeddings()
    assert output_heads(model) == {id(model.out): "the model's get_output_embeddings()"}


def test_only_the_last_layer_shaped_like_the_vocabulary_is_the_head() -> None:
    """The tiny GPT's MLP input projections (64 -> 256) have the vocabulary table's shape
    too, and its attention output (64 x 64) the position table's: only the head counts."""
    model = _untied_gpt()
    assert output_heads(model) == {id(model.head): "maps the width to the vocabulary of embedding 'tok_emb'"}
    model, _ = amp8.initialize(model, None, "O1")
    fp8 = {name for name, module in model.named_modules() if isinstance(module, Fp8Linear)}
    assert len(fp8) == 4 * PRESETS["tiny"].n_layer and "head" not in fp8


def test_a_model_without_a_vocabulary_has_no_head() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    assert output_heads(model) == {}
    model, _ = amp8.initialize(model, None, "O1")
    assert isinstance(model[2], Fp8Linear), "the last layer of a plain MLP is not an output head"


@pytest.mark.integration
@needs_transformers
def test_transformers_llama_head_stays_high() -> None:
    model = LlamaSpec(n_layer=1, n_embd=64, intermediate=128, n_head=4, n_kv_head=2).build(torch.Generator().manual_seed(0))
    assert set(output_heads(model.lm)) == {id(model.lm.lm_head)}
    model, _ = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1")
    assert type(model.lm.lm_head) is nn.Linear
    assert isinstance(model.lm.model.layers[0].mlp.down_proj, Fp8Linear)


@pytest.mark.parametrize(("level", "distributed", "expected"), [
    ("O1", False, RECIPE_DEFAULT),
    ("O1", True, RECIPE_DEFAULT),
    ("O1-compute", False, RECIPE_DEFAULT),
    ("O2", False, RECIPE_DEFAULT),
    ("O2", True, RECIPE_DEFAULT),
    ("O3", False, RECIPE_DEFAULT),
    ("O3", True, amp8.Recipe()),  # a sharded optimizer: one scale per tensor
])
def test_default_recipe_per_level(level: str, distributed: bool, expected: amp8.Recipe) -> None:
    assert default_recipe(resolve_level(level), distributed) == expected


def test_default_is_rowwise_e4m3_with_the_head_high() -> None:
    recipe = default_recipe(resolve_level("O1"))
    assert (recipe.granularity, recipe.fp8_format, recipe.power_of_2_scales, recipe.output_head) == (
        amp8.config.Granularity.ROWWISE, amp8.config.Fp8Format.E4M3, True, amp8.config.recipe.OutputHead.HIGH)
    assert recipe.replace(granularity="tensorwise", fp8_format="HYBRID", power_of_2_scales=False,
                          output_head="fp8") == amp8.Recipe()


def test_output_head_takes_high_or_fp8_only() -> None:
    with pytest.raises(ValueError, match=r"Recipe.output_head='bf16' is not valid; use one of 'high', 'fp8'"):
        amp8.Recipe(output_head="bf16")
