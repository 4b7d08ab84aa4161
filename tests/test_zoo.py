"""amp8 on the models people load: every architecture of tests/zoo_models.py (decoders,
encoders, encoder-decoders, vision, speech, a mixture of experts, a state-space model) at
O1, O2 and O3. Each trains with finite losses, runs its GEMMs in FP8 (a share of the
FLOPs of one forward and backward, measured by torch's FLOP counter), gives a reason in
the precision report for every GEMM weight it keeps in high precision, saves with
``save_pretrained`` what the plain class loads back (the logits of ``amp8.export``), and
reports the dtype it had before ``initialize``; each language model ``generate``s the same
tokens through its key-value cache as without it. Then T5's feed-forward, which casts its
input to ``wo``'s weight dtype, and timm's Vision Transformer: timm's own where timm imports
(its torchvision needs a CUDA build of torch), and everywhere its plain-torch twin
(``zoo_models.TimmStyleViT``), checked against timm's where both run."""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

import amp8
from amp8.nn import Fp8Experts, Fp8Linear

transformers = pytest.importorskip("transformers", reason="the zoo needs transformers: pip install 'amp8[dev]'")
from transformers.pytorch_utils import Conv1D  # noqa: E402  (needs transformers)

from zoo_models import ZOO, ZooModel, image_batch, timm_vit  # noqa: E402

pytestmark = pytest.mark.integration

LEVELS = ["O1", "O2", "O3"]
STEPS = 3
CASES = [pytest.param(name, level, id=f"{name}-{level}") for name in ZOO for level in LEVELS]

GEMM_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, Conv1D, nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""Modules whose weight feeds a GEMM: linear layers (transformers' GPT-2 ``Conv1D`` is one,
its weight transposed) and convolutions (a GEMM over patches)."""

FP8_GEMMS = {"_scaled_mm"}
"""The ops the FLOP counter sees for amp8's FP8 GEMMs (dense layers and experts)."""

# The share of GEMM FLOPs in FP8 over one forward and backward (fp8_share_of_gemm_flops), per
# architecture, the same at O1, O2 and O3, measured on the CPU with torch 2.13 and
# transformers 5.24. The rest is attention's own matmuls, the output head (kept in high
# precision by the default recipe, or tied to the input embedding) and convolutions:
#
#   llama 0.85   qwen2 0.85   phi 0.83   gpt2 0.89   gpt-neox 0.83   falcon 0.88   opt 0.83
#   mixtral 0.93   bert 0.85   distilbert 0.85   t5 0.89   bart 0.88   whisper 0.81
#   vit 0.85 (timm's and the timm-style ViT 0.85 too)   convnext 0.30 (its convolutions)
#   mamba 0.47: without its CUDA kernels, transformers' Mamba multiplies by x_proj, dt_proj
#   and out_proj's weights itself in places (reading their real values); those products
#   run in high precision
MIN_FP8_SHARE = {"gpt2": 0.70}
"""Floors of the FP8 share for the architectures that name one (GPT-2: its tied head
stays high); every other architecture's share must be above 0."""

STORAGE = {"O1": torch.float16, "O2": torch.float16, "O3": torch.float8_e4m3fn}
"""What each level stores an FP8 layer's weight as (with its scales)."""


def _sdpa_on_cpu(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward_on_cpu(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any,
                          *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# torch's FLOP counter knows the CUDA kernels of scaled dot-product attention, not the CPU
# one that transformers' default ("sdpa") attention runs here: counted as torch counts the
# others, attention's matmuls weigh in the share as they do on a GPU.
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_on_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_on_cpu,
}


def _initialized(zoo: ZooModel, level: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = zoo.build()
    return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), opt_level=level)  # type: ignore[return-value]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def fp8_share_of_gemm_flops(step: Callable[[], None]) -> tuple[float, dict[str, int]]:
    """The share of the GEMM FLOPs that ``step()`` (a forward and backward) runs in FP8,
    and the FLOPs per op: torch's FLOP counter counts the GEMMs (``_scaled_mm``, ``mm``,
    ``addmm``, ``bmm``, ``baddbmm``, convolutions, attention) and nothing else."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        step()
    flops = {str(op).split(".")[-1]: count for op, count in counter.get_flop_counts()["Global"].items()}
    total = sum(flops.values())
    assert total > 0, "the FLOP counter saw no GEMM"
    return sum(count for op, count in flops.items() if op in FP8_GEMMS) / total, flops


def layers_kept_without_reason(model: nn.Module, report: Any) -> dict[str, str]:
    """``{fqn: class name}`` of the modules of ``model`` holding a GEMM weight
    (``GEMM_LAYERS``) that are not FP8 layers and have no note in ``report``: the
    report's row of a tied weight is under its first name, which may be another
    module's."""
    notes = {row.name: row.note for row in report.rows}
    row_of = {id(param): param_name for param_name, param in model.named_parameters()}
    return {
        fqn: type(module).__name__ for fqn, module in model.named_modules()
        if isinstance(module, GEMM_LAYERS) and not isinstance(module, Fp8Linear) and not notes[row_of[id(module.weight)]]
    }


def assert_same_logits(got: torch.Tensor, expected: torch.Tensor, level: str, case: str) -> None:
    """``got`` equals ``expected`` within the rounding of the level's weight storage:
    half a step of its format (``finfo.eps / 2``), relative to the logits' size."""
    tolerance = torch.finfo(STORAGE[level]).eps / 2
    torch.testing.assert_close(
        got, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item(),
        msg=lambda text: f"{case} at {level}: the loaded model's logits differ from amp8.export's: {text}",
    )


@pytest.mark.parametrize(("name", "level"), CASES)
def test_zoo_model_trains_with_finite_losses(name: str, level: str) -> None:
    zoo = ZOO[name]
    model, optimizer = _initialized(zoo, level)
    losses = _train(model, optimizer, zoo.make_batch(), STEPS)
    assert all(math.isfinite(loss) for loss in losses), f"{name} at {level}: losses {losses}"


@pytest.mark.parametrize(("name", "level"), CASES)
def test_zoo_model_runs_its_gemms_in_fp8(name: str, level: str) -> None:
    zoo = ZOO[name]
    model, _ = _initialized(zoo, level)
    batch = zoo.make_batch()
    share, flops = fp8_share_of_gemm_flops(lambda: model(**batch).loss.backward())
    message = f"{name} at {level}: {100 * share:.1f}% of GEMM FLOPs in FP8; {flops}"
    if name in MIN_FP8_SHARE:
        assert share >= MIN_FP8_SHARE[name], f"{message}, below the floor of {100 * MIN_FP8_SHARE[name]:.0f}%"
    else:
        assert share > 0, message


@pytest.mark.parametrize(("name", "level"), CASES)
def test_zoo_report_gives_a_reason_for_every_gemm_weight_kept_high(name: str, level: str) -> None:
    model, optimizer = _initialized(ZOO[name], level)
    silent = layers_kept_without_reason(model, amp8.report(model, optimizer))
    assert not silent, f"{name} at {level}: layers kept in high precision without a reason in the report: {silent}"
    fp8 = [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Experts))]
    assert fp8, f"{name} at {level}: no FP8 layer"


@pytest.mark.parametrize(("name", "level"), CASES)
def test_zoo_save_pretrained_loads_into_the_plain_class(name: str, level: str, tmp_path: Path) -> None:
    """``save_pretrained`` writes the real weights: the plain class loads them with no
    key missing, unexpected or mismatched, all finite, and computes the logits of
    ``amp8.export``'s copy. Both hold the stored weights (FP16 with power-of-two scales
    at O1/O2, FP8 with scales at O3), so a state dict that rounds them once more to the
    storage format may move each by half a step of that format (``finfo.eps / 2``) and
    the logits by about as much relative to their size; a missing scale, raw FP8 bytes or
    a freshly initialized weight moves them by far more."""
    zoo = ZOO[name]
    model, optimizer = _initialized(zoo, level)
    batch = zoo.make_batch()
    _train(model, optimizer, batch, 1)  # the saved weights are trained ones, not the initial ones
    model.save_pretrained(tmp_path)
    plain_class = getattr(transformers, zoo.model_class)
    loaded, info = plain_class.from_pretrained(tmp_path, output_loading_info=True)
    problems = {key: value for key, value in info.items() if key != "error_msgs" and value}
    assert not problems, f"{name} at {level}: loading what save_pretrained wrote: {problems}"
    assert type(loaded) is plain_class
    bad = [param_name for param_name, param in loaded.named_parameters() if not torch.isfinite(param).all()]
    assert not bad, f"{name} at {level}: non-finite loaded weights {bad}"
    exported = amp8.export(model)
    with torch.no_grad():
        got = loaded.eval()(**batch).logits
        expected = exported.eval()(**batch).logits
    assert_same_logits(got, expected, level, name)


GENERATORS = [pytest.param(name, level, id=f"{name}-{level}") for name, zoo in ZOO.items()
              if zoo.model_class.endswith(("CausalLM", "LMHeadModel")) for level in LEVELS]
"""The zoo's language models that ``generate`` text, at every level."""


@pytest.mark.parametrize(("name", "level"), GENERATORS)
def test_zoo_decoder_generates_the_same_with_and_without_its_cache(name: str, level: str) -> None:
    """Greedy ``generate`` through the key-value cache (each step's GEMMs take one row per
    sequence, padded for the FP8 GEMM) gives the tokens that recomputing the whole prefix
    at every step gives."""
    zoo = ZOO[name]
    model, _ = amp8.initialize(zoo.build(), None, level)
    model.eval()
    prompt = zoo.make_batch()["input_ids"][:, :5]
    settings = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(prompt, **settings)
        recomputed = model.generate(prompt, use_cache=False, **settings)
    assert cached.shape == (prompt.shape[0], prompt.shape[1] + 6)
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize(("name", "level"), CASES)
def test_zoo_model_dtype_is_the_one_before_initialize(name: str, level: str) -> None:
    model = ZOO[name].build()
    before = model.dtype
    model, _ = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), opt_level=level)
    assert model.dtype == before, f"{name} at {level}: model.dtype {model.dtype}, {before} before initialize"


# -- T5's feed-forward: ``hidden.to(self.wo.weight.dtype)`` before ``wo`` ---------------

T5_FEED_FORWARDS = ["relu", "gated-gelu"]  # T5DenseActDense and T5DenseGatedActDense


def _t5(feed_forward: str) -> ZooModel:
    return replace(ZOO["t5"], config={**ZOO["t5"].config, "feed_forward_proj": feed_forward})


@pytest.mark.parametrize("feed_forward", T5_FEED_FORWARDS)
def test_t5_trains_at_o3(feed_forward: str) -> None:
    """``wo``'s weight reads as a float32 Parameter, so T5 leaves its input as it is
    rather than casting it to FP8 (which fails: FP8 does not promote)."""
    zoo = _t5(feed_forward)
    model, optimizer = _initialized(zoo, "O3")
    losses = _train(model, optimizer, zoo.make_batch(), STEPS)
    assert all(math.isfinite(loss) for loss in losses), losses


@pytest.mark.parametrize("feed_forward", T5_FEED_FORWARDS)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_t5_feed_forward_input_to_wo_stays_in_the_model_dtype(level: str, feed_forward: str) -> None:
    """At O1/O2 the weight is stored in FP16; T5 must not see that and cast ``wo``'s
    input to FP16 (a rounding the model never asked for)."""
    zoo = _t5(feed_forward)
    model = zoo.build()
    dtype = model.dtype
    model, _ = amp8.initialize(model, None, opt_level=level)
    seen: list[torch.dtype] = []
    wos = [module for fqn, module in model.named_modules() if fqn.endswith("DenseReluDense.wo")]
    assert len(wos) == 2 * ZOO["t5"].config["num_layers"] and all(isinstance(wo, Fp8Linear) for wo in wos)
    for wo in wos:
        wo.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    model(**zoo.make_batch()).loss.backward()
    assert seen == [dtype] * len(wos), f"dtypes reaching wo: {seen}, the model's {dtype}"


# -- timm's Vision Transformer ---------------------------------------------------------

@functools.cache  # a failed import leaves torchvision's op registrations half done: try it once
def timm_import_error() -> str | None:
    """Why ``import timm`` fails here, or None. timm imports torchvision, and PyPI's
    torchvision wheels link torch's CUDA libraries: beside a CPU-only build of torch
    (``torch==2.13.0+cpu``) the import raises a RuntimeError (``operator torchvision::nms
    does not exist``), not an ImportError."""
    try:
        import timm  # noqa: F401
    except (ImportError, RuntimeError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return None


VIT_BUILDS = ["timm-style", "timm"]  # TimmStyleViT (plain torch), timm's VisionTransformer


def _vit(build: str, level: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    if build == "timm" and (error := timm_import_error()) is not None:
        pytest.skip(f"timm does not import here ({error}); TimmStyleViT, the same model in plain torch, runs instead")
    model = timm_vit(use_timm=build == "timm")
    return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), opt_level=level)  # type: ignore[return-value]


def _vit_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    pixels, labels = batch
    return nn.functional.cross_entropy(model(pixels), labels)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("build", VIT_BUILDS)
def test_timm_vit_trains_in_fp8_with_a_reason_for_every_layer_kept_high(build: str, level: str) -> None:
    model, optimizer = _vit(build, level)
    batch = image_batch()
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = _vit_loss(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(loss) for loss in losses), f"{build} ViT at {level}: losses {losses}"
    share, flops = fp8_share_of_gemm_flops(lambda: _vit_loss(model, batch).backward())
    assert share > 0, f"{build} ViT at {level}: no GEMM FLOPs in FP8; {flops}"
    silent = layers_kept_without_reason(model, amp8.report(model, optimizer))
    assert not silent, f"{build} ViT at {level}: layers kept in high precision without a reason in the report: {silent}"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("build", VIT_BUILDS)
def test_timm_vit_state_dict_loads_into_the_plain_model(build: str, level: str) -> None:
    """timm models save and load through ``state_dict``: the plain model loads amp8's
    strictly and computes the logits of ``amp8.export``'s copy."""
    model, optimizer = _vit(build, level)
    batch = image_batch()
    optimizer.zero_grad()
    _vit_loss(model, batch).backward()
    optimizer.step()
    plain = timm_vit(use_timm=build == "timm", seed=1)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        got = plain.eval()(batch[0])
        expected = amp8.export(model).eval()(batch[0])
    assert_same_logits(got, expected, level, f"{build} ViT")


def test_timm_style_vit_is_timms_vision_transformer() -> None:
    """Where timm imports, ``TimmStyleViT`` has timm's parameter names and shapes and,
    given its weights, computes its logits bit for bit: the timm-style cases above test
    what timm's model would show."""
    if (error := timm_import_error()) is not None:
        pytest.skip(f"timm does not import here ({error})")
    timm_model, plain = timm_vit(use_timm=True), timm_vit(use_timm=False, seed=1)
    shapes = {key: value.shape for key, value in timm_model.state_dict().items()}
    assert {key: value.shape for key, value in plain.state_dict().items()} == shapes
    plain.load_state_dict(timm_model.state_dict())
    pixels, _ = image_batch()
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(pixels), timm_model.eval()(pixels), atol=0, rtol=0)
