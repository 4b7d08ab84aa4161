"""amp8 inside the trainers people use: Hugging Face's Trainer, Accelerate, Lightning.

Each trainer runs an amp8 model with the optimizer ``amp8.initialize`` returns, gradient
clipping and gradient accumulation on, and is compared with the loop a user would write by
hand from the same seed, on the same batches: the trainers add nothing to amp8's numerics.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import amp8
import multiprocess
from amp8.tensor.stored import is_fp8_weight
from amp8.tensor.weight_grad import WeightGrad
from conftest import assert_bitwise_equal

pytestmark = pytest.mark.integration

LEVELS = ["O1", "O2"]
ACCUMULATION = 2
MAX_NORM = 1.0
BATCH = 4
WIDTH = 32


class Regression(nn.Module):
    """A two-layer MLP whose forward returns Hugging Face's ``{"loss", "logits"}`` and
    keeps the batches it trained on, so a hand-written loop can replay them in order."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, 64), nn.GELU(), nn.Linear(64, WIDTH))
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.seen.append((x.clone(), labels.clone()))
        logits = self.net(x)  # (B, WIDTH)
        return {"loss": (logits - labels).pow(2).mean(), "logits": logits}


def _data(samples: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of a learnable map, large enough that clipping at 1.0 acts."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, WIDTH, generator=generator)
    target = 0.5 * x @ torch.randn(WIDTH, WIDTH, generator=generator) + 1.0  # (samples, WIDTH)
    return x, target


def _build(level: str) -> tuple[Regression, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The same amp8 model, optimizer and scheduler (built after initialize) from seed 0."""
    torch.manual_seed(0)
    model = Regression()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = amp8.initialize(model, optimizer, level, recipe=amp8.Recipe())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _hand_loop(
    level: str, batches: list[tuple[torch.Tensor, torch.Tensor]], max_norm: float = MAX_NORM
) -> dict[str, Any]:
    """What the trainers do, written out: the loss of each micro-batch divided by the
    accumulation steps, ``torch.nn.utils.clip_grad_norm_`` once per step, step, schedule,
    ``model.zero_grad()``. Per step: the mean micro-batch loss and the norm before clipping
    (both ``amp8.clip_grad_norm_``'s and torch's)."""
    model, optimizer, scheduler = _build(level)
    losses, norms, amp8_norms = [], [], []
    for start in range(0, len(batches), ACCUMULATION):
        total = torch.zeros(())
        for x, labels in batches[start : start + ACCUMULATION]:
            loss = model(x, labels)["loss"] / ACCUMULATION
            loss.backward()
            total += loss.detach()
        amp8_norms.append(float(amp8.clip_grad_norm_(model, math.inf)))  # measures, clips nothing
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        scheduler.step()
        model.zero_grad()
        losses.append(total.item())
    return {"losses": losses, "norms": norms, "amp8_norms": amp8_norms, "model": model}


def _loss_on_all(model: Regression, x: torch.Tensor, target: torch.Tensor) -> float:
    """The loss over every sample, from a copy of ``model`` (the original keeps its
    scales and records no batch)."""
    copy_ = copy.deepcopy(model).eval()
    with torch.no_grad():
        return copy_(x, target)["loss"].item()


def _assert_same_state(actual: nn.Module, expected: nn.Module) -> None:
    """Every parameter and buffer bit for bit."""
    expected_state = expected.state_dict()
    for name, value in actual.state_dict().items():
        assert_bitwise_equal(value, expected_state[name])


def _assert_clipped(pre: list[float], post: list[float], max_norm: float) -> None:
    """Clipping acted: some step's norm exceeded ``max_norm``, and after clipping every
    step's total norm, FP8 weight gradients included, is within it."""
    assert max(pre) > max_norm, f"no step needed clipping (norms {pre}); the test would prove nothing"
    for before, after in zip(pre, post):
        assert after == pytest.approx(min(before, max_norm), rel=1e-5), (
            f"norm {before:.6f} clipped to {after:.6f}, expected {min(before, max_norm):.6f}"
        )


# -- Hugging Face Trainer ------------------------------------------------------------------
def _hf_trainer(level: str, folder: Path, max_norm: float = MAX_NORM) -> dict[str, Any]:
    """Train with ``transformers.Trainer`` (its defaults for clipping; accumulation 2);
    per step the logged loss and grad norm, and the norm left after clipping. In a process
    group the Trainer wraps the model in DDP, registered at its first forward."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.logs: list[dict[str, float]] = []
            self.clipped: list[float] = []
            self.grad_types: set[type] = set()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: nn.Module, **kwargs: Any) -> None:
            self.grad_types |= {type(p.grad) for p in model.parameters() if is_fp8_weight(p)}
            self.clipped.append(float(amp8.clip_grad_norm_(model, math.inf)))

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float], **kwargs: Any) -> None:
            self.logs.append(dict(logs))

    x, target = _data()
    dataset = [{"x": x[i], "labels": target[i]} for i in range(len(x))]
    model, optimizer, scheduler = _build(level)
    amp8.distributed.register_ddp_when_wrapped(model)  # nothing in one process
    record = Record()
    args = TrainingArguments(
        output_dir=str(folder), use_cpu=True, save_strategy="no", report_to=[], seed=0,
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION,
        max_grad_norm=max_norm, max_steps=4, logging_steps=1, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, optimizers=(optimizer, scheduler),
                      callbacks=[record])
    trainer.train()
    steps = [log for log in record.logs if "grad_norm" in log]
    group = amp8.distributed.data_parallel_group(model)
    return {
        "losses": [log["loss"] for log in steps], "norms": [log["grad_norm"] for log in steps],
        "clipped": record.clipped, "grad_types": record.grad_types, "model": model,
        "wrapper": type(trainer.model_wrapped).__name__,
        "registered": group is not None and group.ddp is trainer.model_wrapped,
    }


def _hf_trainer_rank(rank: int, world: int, level: str, folder: str, max_norm: float) -> dict[str, Any]:
    """One rank of a two-process ``Trainer`` run (``torchrun``'s environment)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    result = _hf_trainer(level, Path(folder) / str(rank), max_norm)
    model = result.pop("model")
    result["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    result["seen"] = len(model.seen)
    return result


@pytest.mark.multiprocess
def test_hf_trainer_two_processes_register_its_ddp_and_agree(tmp_path: Path) -> None:
    max_norm = 0.5  # averaged gradients are smaller than one rank's: clip lower so it acts
    ranks = multiprocess.run(_hf_trainer_rank, tmp_path, "O2", str(tmp_path), max_norm)
    for r in ranks:
        assert r["wrapper"] == "DistributedDataParallel" and r["registered"], (r["wrapper"], r["registered"])
        assert r["seen"] == 4 * ACCUMULATION
    assert ranks[0]["norms"] == ranks[1]["norms"], "both ranks see the norm of the averaged gradients"
    _assert_clipped(ranks[0]["norms"], ranks[0]["clipped"], max_norm)
    for name, value in ranks[0]["params"].items():
        assert_bitwise_equal(value, ranks[1]["params"][name])


@pytest.mark.parametrize("level", LEVELS)
def test_hf_trainer_matches_hand_written_loop(level: str, tmp_path: Path) -> None:
    trained = _hf_trainer(level, tmp_path)
    model = trained["model"]
    assert len(model.seen) == 4 * ACCUMULATION, f"{len(model.seen)} micro-batches for 4 steps"
    reference = _hand_loop(level, model.seen)
    # Same batches, same order, same arithmetic: the curve and the weights agree bit for bit.
    assert trained["losses"] == reference["losses"], f"Trainer {trained['losses']} != loop {reference['losses']}"
    assert trained["norms"] == reference["norms"], f"Trainer {trained['norms']} != loop {reference['norms']}"
    _assert_same_state(model, reference["model"])


@pytest.mark.parametrize("level", LEVELS)
def test_hf_trainer_clips_fp8_gradients(level: str, tmp_path: Path) -> None:
    trained = _hf_trainer(level, tmp_path)
    assert trained["grad_types"] == {WeightGrad}, f"FP8 weights' .grad at the step: {trained['grad_types']}"
    reference = _hand_loop(level, trained["model"].seen)
    # The logged grad norm is the true total norm, FP8 weight gradients included.
    for logged, true in zip(trained["norms"], reference["amp8_norms"]):
        assert logged == pytest.approx(true, rel=1e-6), f"Trainer logged {logged}, amp8 measures {true}"
    _assert_clipped(trained["norms"], trained["clipped"], MAX_NORM)


# -- Accelerate ------------------------------------------------------------------------------
def _accelerate(level: str, max_norm: float = MAX_NORM) -> dict[str, Any]:
    """Train with ``accelerator.prepare``, ``accumulate()`` and ``clip_grad_norm_``: one
    process, or one rank of a process group (then the model runs under DDP)."""
    from accelerate import Accelerator

    model, optimizer, scheduler = _build(level)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    x, target = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, target), batch_size=BATCH)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):  # several processes
        amp8.distributed.register_ddp(model)
    norms, clipped, losses = [], [], []
    for inputs, labels in loader:
        with accelerator.accumulate(model):
            loss = model(inputs, labels)["loss"]
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), max_norm)))
                clipped.append(float(amp8.clip_grad_norm_(optimizer.optimizer, math.inf)))
            optimizer.step()
            scheduler.step()  # accelerate steps it once per optimizer step and process
            optimizer.zero_grad()
        losses.append(loss.item())
    inner = accelerator.unwrap_model(model)
    low_bit = optimizer.optimizer
    steps = {int(state["step"]) for state in low_bit.state.values()}
    return {
        "wrapper": type(model).__name__, "norms": norms, "clipped": clipped, "losses": losses,
        "steps": steps, "skipped": low_bit.skipped_steps, "seen": inner.seen,
        "params": {name: p.detach().clone() for name, p in inner.named_parameters()}, "model": inner,
    }


@pytest.mark.parametrize("level", LEVELS)
def test_accelerate_one_process_matches_hand_written_loop(level: str) -> None:
    trained = _accelerate(level)
    assert trained["wrapper"] == "Regression", "one process: accelerate leaves the model unwrapped"
    # accumulate(): 8 micro-batches, 4 optimizer steps, none skipped.
    assert len(trained["seen"]) == 8 and trained["steps"] == {4} and trained["skipped"] == 0, trained["steps"]
    reference = _hand_loop(level, trained["seen"])
    assert trained["norms"] == reference["norms"], f"accelerate {trained['norms']} != loop {reference['norms']}"
    _assert_same_state(trained["model"], reference["model"])
    _assert_clipped(trained["norms"], trained["clipped"], MAX_NORM)


def _accelerate_rank(rank: int, world: int, level: str, max_norm: float) -> dict[str, Any]:
    """One rank of ``accelerate launch --cpu``: the process group exists already, the
    environment says how large it is."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    result = _accelerate(level, max_norm)
    del result["model"], result["seen"]
    return result


@pytest.mark.multiprocess
@pytest.mark.parametrize("level", ["O2"])
def test_accelerate_two_processes_agree(level: str, tmp_path: Path) -> None:
    max_norm = 0.5  # averaged gradients are smaller than one rank's: clip lower so it acts
    ranks = multiprocess.run(_accelerate_rank, tmp_path, level, max_norm)
    assert [r["wrapper"] for r in ranks] == ["DistributedDataParallel"] * 2
    assert ranks[0]["losses"] != ranks[1]["losses"], "the ranks should see different batches"
    for r in ranks:
        assert r["steps"] == {2} and r["skipped"] == 0, f"{r['steps']} steps, {r['skipped']} skipped"
    # Both ranks measured the norm of the averaged gradients and clipped alike...
    assert ranks[0]["norms"] == ranks[1]["norms"], f"rank norms {ranks[0]['norms']} != {ranks[1]['norms']}"
    _assert_clipped(ranks[0]["norms"], ranks[0]["clipped"], max_norm)
    # ...so they end with the same parameters, FP8 weights and biases alike.
    for name, value in ranks[0]["params"].items():
        assert_bitwise_equal(value, ranks[1]["params"][name])


# -- Lightning --------------------------------------------------------------------------------
def _lightning_module(level: str) -> Any:
    import lightning

    class Module(lightning.LightningModule):
        """``amp8.initialize`` in ``__init__``, the amp8 optimizer from
        ``configure_optimizers``; records the norm before and after Lightning clips."""

        def __init__(self) -> None:
            super().__init__()
            self.model, self._optimizer, self._scheduler = _build(level)
            self.norms: list[float] = []
            self.clipped: list[float] = []

        def training_step(self, batch: list[torch.Tensor], batch_index: int) -> torch.Tensor:
            return self.model(*batch)["loss"]

        def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                        gradient_clip_algorithm: Any = None) -> None:
            self.norms.append(float(amp8.clip_grad_norm_(self.model, math.inf)))
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            self.clipped.append(float(amp8.clip_grad_norm_(self.model, math.inf)))

        def configure_optimizers(self) -> Any:
            return {"optimizer": self._optimizer, "lr_scheduler": {"scheduler": self._scheduler, "interval": "step"}}

    return Module()


@pytest.mark.parametrize("level", LEVELS)
def test_lightning_matches_hand_written_loop(level: str) -> None:
    import lightning

    module = _lightning_module(level)
    first = module.model.net[0]
    before = first.read_weight().clone()
    x, target = _data()
    loss_before = _loss_on_all(module.model, x, target)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, target), batch_size=BATCH)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=4, gradient_clip_val=MAX_NORM,
        accumulate_grad_batches=ACCUMULATION, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader)
    assert trainer.global_step == 4, f"{trainer.global_step} optimizer steps"
    assert not torch.equal(first.read_weight(), before), "the FP8 layer's weight did not change"
    _assert_clipped(module.norms, module.clipped, MAX_NORM)
    reference = _hand_loop(level, module.model.seen)
    assert module.norms == reference["amp8_norms"], f"Lightning {module.norms} != loop {reference['amp8_norms']}"
    loss_after = _loss_on_all(module.model, x, target)
    assert loss_after < 0.95 * loss_before, f"loss over all samples {loss_before:.4f} -> {loss_after:.4f}"
    _assert_same_state(module.model, reference["model"])
