"""studies/stress_layers.py: the outliers change nothing in exact arithmetic."""

from __future__ import annotations

import torch

from conftest import load_study


def test_stress_layers_outliers_change_nothing_in_exact_arithmetic() -> None:
    """Positions never meet and position 0's loss is ignored: O0 trains bit for bit as
    without the outliers, so every stressed FP8 gap is FP8's."""
    stress_layers = load_study("stress_layers")
    setup = stress_layers.Setup(width=32, hidden=64, steps=4, batch_size=2, block_size=16, warmup=1)
    data = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    x, y = stress_layers.sample_batch(data, 2, 16, torch.Generator().manual_seed(1))

    def train(stressed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = stress_layers.TokenwiseMLP(setup)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        injection = stress_layers.outlier_injection(setup)
        if stressed:
            stress_layers.attach(injection, model)
        model.blocks[3].register_forward_hook(lambda m, args, out: largest.append(float(out.abs().max())))
        for step in range(setup.steps):
            injection.step = step
            optimizer.zero_grad()
            model(x, stress_layers.mask_position(y, 0))[1].backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    largest: list[float] = []
    stressed = train(True)
    assert max(largest) > 2.0**40, "the outliers reach the residual stream"
    for stressed_param, plain in zip(stressed, train(False)):
        assert torch.equal(stressed_param, plain)
