"""Which eligible ``nn.Linear`` layers run in FP8: a speed rule per device type.

An FP8 layer pays for its casts and amax reductions with memory traffic that grows with
the weight and activations, while the GEMM saving grows with the FLOPs; on small layers
the casts win and FP8 is slower than BF16. A ``SpeedRule`` keeps such layers in high
precision. ``SpeedRule.fit`` derives one from measured speedups (``bench/linear.py
--sweep`` prints it for the GPU it runs on); ``DEFAULT_RULES`` holds one per device type.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping

from torch import nn

from amp8.nn.gemm_layers import gemm_features


@dataclass(frozen=True)
class SpeedRule:
    """FP8 where ``min(in, out) >= min_features`` and ``in * out >= min_weight_elements``.

    Attributes:
        min_features: the smaller of in_features and out_features must reach this.
        min_weight_elements: in_features * out_features must reach this.
        source: where the thresholds come from (a measurement, with its device).
    """

    min_features: int
    min_weight_elements: int
    source: str

    def __post_init__(self) -> None:
        for name in ("min_features", "min_weight_elements"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"SpeedRule.{name}={value!r} is not valid; use an int >= 0")
        if not isinstance(self.source, str):
            raise ValueError(
                f"SpeedRule.source={self.source!r} is not valid; use a str saying where the "
                "thresholds come from (a measurement, with its device)"
            )

    def selects(self, in_features: int, out_features: int) -> bool:
        """True when a layer of this size is expected to be faster in FP8."""
        return (
            min(in_features, out_features) >= self.min_features
            and in_features * out_features >= self.min_weight_elements
        )

    def reason(self, linear: nn.Module) -> str | None:
        """Why the GEMM layer ``linear`` (an ``nn.Linear`` or ``Conv1D``-like) stays in
        high precision under this rule, or None."""
        in_features, out_features = gemm_features(linear)
        if self.selects(in_features, out_features):
            return None
        return (
            f"FP8 slower than high precision at in_features={in_features}, "
            f"out_features={out_features} (speed rule: min(in, out) >= "
            f"{self.min_features} and in*out >= {self.min_weight_elements}; {self.source})"
        )

    @classmethod
    def fit(cls, measurements: Iterable[Mapping[str, float]], source: str) -> "SpeedRule":
        """The least strict rule that selects no measured shape with a speedup below 1.

        Each measurement has ``in_features``, ``out_features`` and ``speedup`` (high
        precision time / FP8 time). Among the thresholds seen in the data, the rule keeps
        the one that selects the most shapes while every selected shape is faster in FP8.
        """
        rows = [_measurement(m) for m in measurements]
        if not rows:
            raise ValueError("SpeedRule.fit needs at least one measurement")
        feature_steps = sorted({min(i, o) for i, o, _ in rows} | {0})
        element_steps = sorted({i * o for i, o, _ in rows} | {0})
        best: tuple[int, int, int] = (0, 0, 0)  # (shapes selected, -min_features, -min_elements)
        for min_features in feature_steps:
            for min_elements in element_steps:
                selected = [s for i, o, s in rows if min(i, o) >= min_features and i * o >= min_elements]
                if selected and all(s >= 1.0 for s in selected):
                    best = max(best, (len(selected), -min_features, -min_elements))
        if best[0] == 0:  # FP8 was never faster: a rule no measured shape meets
            return cls(max(max(i, o) for i, o, _ in rows) + 1, 0, source)
        return cls(-best[1], -best[2], source)

    def to_json(self) -> str:
        """The rule as JSON (``SpeedRule.from_json`` reads it back)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "SpeedRule":
        """A rule from JSON text or a file holding it (as ``bench/linear.py --sweep`` writes)."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        data = json.loads(text)
        data = data.get("speed_rule", data) if isinstance(data, dict) else data
        keys = ("min_features", "min_weight_elements", "source")
        if not isinstance(data, dict) or any(key not in data for key in keys):
            raise ValueError(
                f"SpeedRule.from_json({str(text_or_path)[:80]!r}) holds no speed rule; it needs an "
                f"object with {', '.join(keys)} (at the top or under 'speed_rule'), as "
                "SpeedRule.to_json and bench/linear.py --sweep write"
            )
        return cls(data["min_features"], data["min_weight_elements"], data["source"])


def _measurement(measurement: Mapping[str, float]) -> tuple[int, int, float]:
    """``(in_features, out_features, speedup)`` of one measurement for ``SpeedRule.fit``.

    Raises:
        ValueError: a missing key, features that are not positive ints, or a speedup that
            is not a positive finite number.
    """
    try:
        in_features, out_features = measurement["in_features"], measurement["out_features"]
        speedup = float(measurement["speedup"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"SpeedRule.fit measurement {measurement!r} is not valid; each needs in_features, "
            "out_features (positive ints) and speedup (high precision time / FP8 time)"
        ) from None
    features_ok = all(
        isinstance(f, int) and not isinstance(f, bool) and f > 0 for f in (in_features, out_features)
    )
    if not features_ok or not (math.isfinite(speedup) and speedup > 0):
        raise ValueError(
            f"SpeedRule.fit measurement {dict(measurement)!r} is not valid; in_features and "
            "out_features must be positive ints and speedup a positive finite number"
        )
    return in_features, out_features, speedup


# Provisional until amp8's own GPU sweep replaces it: the smallest layers public H100
# measurements of tensorwise FP8 training found faster than BF16, made stricter on both
# axes so that no selected layer is expected to be slower.
_CUDA_PROVISIONAL = SpeedRule(
    min_features=1024,
    min_weight_elements=1 << 23,
    source="provisional CUDA default, from public H100 tensorwise measurements",
)

DEFAULT_RULES: Mapping[str, SpeedRule | None] = {
    # On the CPU the FP8 GEMMs are emulated and always slower; amp8 runs there to check
    # numerics, so every eligible layer is selected.
    "cpu": None,
    "cuda": _CUDA_PROVISIONAL,
}

LayerSelection = str | SpeedRule
"""``"auto"`` (the rule of the model's device type), ``"all"``, or a ``SpeedRule``."""


def resolve_selection(selection: LayerSelection, device_type: str) -> SpeedRule | None:
    """The rule ``selection`` stands for on ``device_type`` (None: select every layer)."""
    if isinstance(selection, SpeedRule):
        return selection
    if selection == "all":
        return None
    if selection == "auto":
        return DEFAULT_RULES.get(device_type)
    raise ValueError(
        f"layer_selection={selection!r} is not valid; use 'auto' (the speed rule of the "
        f"model's device), 'all' (every eligible layer), or an amp8.nn.selection.SpeedRule"
    )
