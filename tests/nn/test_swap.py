import pytest
from torch import nn

from amp8 import Recipe
from amp8.nn import Fp8Linear, high_precision_reason, shared_weight_names, swap_linear_layers


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 2)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 10)


def _to_fp8(linear: nn.Linear) -> Fp8Linear:
    return Fp8Linear.from_linear(linear, Recipe())


def test_swaps_eligible_layers_and_reports_the_rest() -> None:
    model = Block()
    weights = {name: p for name, p in model.named_parameters()}
    kept = swap_linear_layers(model, _to_fp8)
    assert isinstance(model.mlp[0], Fp8Linear) and isinstance(model.mlp[2], Fp8Linear)
    assert kept.pop("head") == "out_features=10 is not a multiple of 16"
    # MultiheadAttention reads out_proj.weight directly: untouched, and the reason says so.
    assert "F.multi_head_attention_forward" in kept.pop("attn.out_proj")
    assert kept == {}
    assert type(model.attn.out_proj) is not Fp8Linear
    assert all(p is weights[name] for name, p in model.named_parameters()), "Parameters must be reused"


def test_filter_sees_children_first_with_full_names() -> None:
    model = nn.Sequential(Block(), nn.Linear(32, 32))
    seen: list[str] = []

    def only_first_mlp_layer(module: nn.Module, fqn: str) -> bool:
        seen.append(fqn)
        return fqn == "0.mlp.0"

    kept = swap_linear_layers(model, _to_fp8, only_first_mlp_layer)
    assert seen == ["0.mlp.0", "0.mlp.2", "1"]
    assert isinstance(model[0].mlp[0], Fp8Linear)
    assert kept["0.mlp.2"] == "excluded by module_filter"


def test_tied_weights_stay_in_high_precision() -> None:
    embed = nn.Embedding(64, 32)
    head = nn.Linear(32, 64, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    assert shared_weight_names(model) == {id(embed.weight): ["embed.weight", "head.weight"]}
    kept = swap_linear_layers(model, _to_fp8)
    assert type(model["head"]) is nn.Linear
    assert "weight is shared (embed.weight, head.weight)" in kept["head"]


@pytest.mark.parametrize(
    ("in_features", "out_features", "reason"),
    [
        (32, 16, None),
        (30, 16, "in_features=30 is not a multiple of 16"),
        (32, 10, "out_features=10 is not a multiple of 16"),
    ],
)
def test_high_precision_reason(in_features: int, out_features: int, reason: str | None) -> None:
    assert high_precision_reason(nn.Linear(in_features, out_features), {}) == reason


def test_bare_linear_is_rejected() -> None:
    with pytest.raises(TypeError, match="nn.Sequential"):
        swap_linear_layers(nn.Linear(32, 32), _to_fp8)


def _bert_classifier(labels: int):
    from transformers import BertConfig, BertForSequenceClassification

    # intermediate_size == vocab_size: the FFN's up projection has the word table's shape.
    config = BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
        num_labels=labels,
    )
    return BertForSequenceClassification(config)


def _gpt2_classifier(labels: int):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=1, n_head=2, num_labels=labels)
    return GPT2ForSequenceClassification(config)


@pytest.mark.parametrize(("build", "head"), [(_bert_classifier, "classifier"), (_gpt2_classifier, "score")])
@pytest.mark.parametrize("output_head", ["high", "fp8"])
def test_classification_head_follows_output_head(build, head: str, output_head: str) -> None:
    model = build(32)
    kept = swap_linear_layers(model, _to_fp8, keep_output_heads=output_head == "high")
    if output_head == "high":
        assert kept == {head: (
            "output head (classification head: the last GEMM layer, with model.config.num_labels=32 outputs), "
            "kept by Recipe.output_head='high'; output_head='fp8' runs it in FP8"
        )}
    else:
        assert kept == {} and isinstance(model.get_submodule(head), Fp8Linear)


def test_a_classification_head_with_few_labels_is_kept_for_its_shape() -> None:
    model = _bert_classifier(2)
    kept = swap_linear_layers(model, _to_fp8, keep_output_heads=True)
    assert kept == {"classifier": "out_features=2 is not a multiple of 16"}
    assert isinstance(model.bert.encoder.layer[0].intermediate.dense, Fp8Linear), "an FFN is no vocabulary head"
