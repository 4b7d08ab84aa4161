"""Where FP8 error enters training: paired gaps to O0, one source at a time.

    python studies/numerics_ablation.py --configs docs-lr3e-3 --variants O1-e5m2 O2-e5m2 O3-e5m2
    python studies/numerics_ablation.py --configs docs-lr3e-3 --variants sources
    python studies/numerics_ablation.py --configs all --variants levels --steps 600 --seeds 0 1 2 3 4
    python studies/numerics_ablation.py --configs docs-lr0.003 stdlib-lr0.003 --variants gradients --gradients
    python studies/numerics_ablation.py --table      # the recorded results as markdown

Every configuration trains the byte-level GPT (``small`` preset, 16 sequences of 64 bytes
per step) at O0 and at each variant from the same seeds, on the same batches; a variant's
gap is the mean over seeds of (its final validation loss - O0's) / O0's, in percent.
Variants change one thing at a time against O1 with the 0.1 recipe's weight gradients
(E5M2, one scale per tensor): one GEMM in high precision, the weight gradient's storage,
the gradient format, the scale granularity; the O2 and O3 rows add the low-bit moments
and the FP8 weights beside FP16 masters. Results are merged into
studies/results/numerics_ablation-<device>.json (each configuration's O0 losses are kept
and reused), so a study can be run in parts.

The configurations, the variants and their named groups are in studies/ablation_cases.py.
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import subprocess
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from ablation_cases import BASE, CONFIGS, GROUPS, REALISTIC_CONFIGS, TARGET_CONFIGS, VARIANTS
from amp8 import initialize
from amp8.monitor.console import default_console
from amp8.quant.scaling import sqnr
from amp8.tensor.stored import stored_weight
from amp8.tools.experiments.compare import _param_groups
from amp8.tools.experiments.corpus import load_corpus, sample_batch
from amp8.tools.experiments.paired import BASELINE, PairedResult, paired_runs, standard_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/records.py writes the results
from records import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "numerics_ablation"


def _path(device: torch.device) -> Path:
    return RESULTS / f"{NAME}-{'cuda' if device.type == 'cuda' else 'cpu'}.json"


def summarize(study: dict[str, Any]) -> None:
    """Fill a study's per-seed and mean paired gaps from its losses (seeds O0 has), and
    the standard error of each mean (the seeds' spread of gaps over sqrt(seeds))."""
    base = study["losses"].get(BASELINE, {})
    study["gaps_percent"], study["mean_gap_percent"], study["stderr_percent"] = {}, {}, {}
    for name, losses in study["losses"].items():
        seeds = [seed for seed in losses if seed in base]
        if name == BASELINE or not seeds:
            continue
        gaps = {seed: 100 * (losses[seed] - base[seed]) / base[seed] for seed in seeds}
        study["gaps_percent"][name] = gaps
        study["mean_gap_percent"][name] = statistics.fmean(gaps.values())
        if len(gaps) > 1:
            study["stderr_percent"][name] = standard_error(list(gaps.values()))


def _code_version() -> str:
    """The amp8 commit the runs train with (``+changes`` when the tree differs from it)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "amp8"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if dirty else "")


def run(config_names: list[str], variant_names: list[str], seeds: list[int], steps: int,
        tag: str = "") -> dict[str, Any]:
    """Train the study, seed by seed, merging each run into the JSON as it ends (runs
    already there are not trained again); returns the merged studies. ``tag`` names a
    separate study of the same configuration (another version of amp8, say)."""
    console = default_console()
    device = torch.device(BASE.device)
    path = _path(device)
    studies: dict[str, Any] = json.loads(path.read_text())["studies"] if path.is_file() else {}
    for config_name in config_names:
        config = CONFIGS[config_name].replace(steps=steps, eval_interval=steps)
        key = f"{config_name} steps={steps}" + (f" {tag}" if tag else "")
        study = studies.setdefault(key, {"configuration": config_name, "steps": steps, "losses": {}})
        if tag:  # O0 trains without amp8: a tagged study takes the untagged study's O0 runs
            untagged = studies.get(f"{config_name} steps={steps}", {}).get("losses", {}).get(BASELINE, {})
            for seed, loss in untagged.items():
                study["losses"].setdefault(BASELINE, {}).setdefault(seed, loss)
        study["config"] = PairedResult(config, (), ()).to_dict()["config"]
        study["code"] = _code_version()
        for seed in seeds:
            done = study["losses"]
            todo = [VARIANTS[name] for name in variant_names if str(seed) not in done.get(name, {})]
            baseline = [done[BASELINE][str(seed)]] if str(seed) in done.get(BASELINE, {}) else None
            for variant in todo:  # one at a time, so each run is saved as soon as it ends
                result = paired_runs(config, [variant], [seed], baseline=baseline)
                for name, losses in result.losses.items():
                    done.setdefault(name, {})[str(seed)] = losses[0]
                for name, losses in result.train_losses.items():
                    study.setdefault("train_losses", {}).setdefault(name, {})[str(seed)] = losses[0]
                study.setdefault("variants", {})[variant.name] = variant.describe()
                study.setdefault("skipped_steps", {}).setdefault(variant.name, {})[str(seed)] = (
                    result.skipped_steps[variant.name][0])
                study.setdefault("wall_s", {}).setdefault(variant.name, {})[str(seed)] = result.wall_s[variant.name][0]
                baseline = [done[BASELINE][str(seed)]]
                console.print(f"{key} seed {seed} {variant.name}: {done[variant.name][str(seed)]:.4f} "
                              f"(O0 {baseline[0]:.4f})", highlight=False)
                _save_study(device, key, study)
        summarize(study)
        console.print(f"{key}: mean gaps " + ", ".join(
            f"{name} {gap:+.3f}% ({len(study['gaps_percent'][name])} seeds)"
            for name, gap in study["mean_gap_percent"].items()), highlight=False)
    return studies


@torch.no_grad()
def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (stored.grad().dequantize() if (stored := stored_weight(param)) else param.grad).clone()
            for name, param in model.named_parameters() if stored_weight(param) is not None or param.grad is not None}


def gradient_error(config_name: str, variant_names: list[str], train_steps: int, batches: int,
                   seed: int = 0) -> dict[str, Any]:
    """Where the error enters one step, without the noise of whole runs: train O0 for
    ``train_steps`` under the configuration, then, on ``batches`` fixed batches, compare
    each variant's gradients with FP32's. Per variant: the SQNR (dB) of the weight
    gradients of the FP8 layers (mean over layers and batches, and the worst layer), of
    the position embedding's gradient (what reaches the bottom of the network through
    every FP8 input-gradient GEMM), and the loss's relative error (the forward GEMMs)."""
    config = CONFIGS[config_name]
    corpus = load_corpus(config.corpus)
    generator = torch.Generator().manual_seed(seed)
    model = config.model.build(torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.95))
    for step in range(train_steps):
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step)
        x, y = sample_batch(corpus.train, config.batch_size, config.model.block_size, generator)
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
    data = [sample_batch(corpus.train, config.batch_size, config.model.block_size, generator) for _ in range(batches)]
    references = []
    for x, y in data:
        model.zero_grad()
        loss = model(x, y)[1]
        loss.backward()
        references.append((float(loss.detach()), {name: param.grad.clone() for name, param in model.named_parameters()}))
    rows: dict[str, Any] = {}
    for name in variant_names:
        variant = VARIANTS[name]
        copy_ = copy.deepcopy(model)
        fp8, _ = initialize(copy_, torch.optim.AdamW(copy_.parameters()), variant.level, recipe=variant.recipe,
                            layer_selection="all")
        layer_sqnr: dict[str, list[float]] = {}
        position, loss_error = [], []
        for (x, y), (reference_loss, reference) in zip(data, references):
            fp8.zero_grad()
            loss = fp8(x, y)[1]
            loss.backward()
            grads = _snapshot(fp8)
            for key, grad in grads.items():
                if grad.dim() == 2 and "emb" not in key:
                    layer_sqnr.setdefault(key, []).append(sqnr(reference[key], grad))
            position.append(sqnr(reference["pos_emb.weight"], grads["pos_emb.weight"]))
            loss_error.append(abs(float(loss.detach()) - reference_loss) / reference_loss)
        per_layer = {key: statistics.fmean(values) for key, values in layer_sqnr.items()}
        rows[name] = {
            "weight_grad_sqnr_db": statistics.fmean(per_layer.values()),
            "worst_layer_sqnr_db": min(per_layer.values()),
            "position_grad_sqnr_db": statistics.fmean(position),
            "loss_relative_error_percent": 100 * statistics.fmean(loss_error),
            "per_layer_db": per_layer,
        }
    return {"configuration": config_name, "train_steps": train_steps, "batches": batches, "seed": seed,
            "variants": rows}


def markdown(data: dict[str, Any], configs: list[str] | None = None) -> str:
    """The studies as markdown tables: paired gap (mean ± standard error over seeds, in
    percent) per variant and configuration (those of ``configs`` only, when given), and
    the one-step gradient errors."""
    lines = []
    studies = {key: study for key, study in data.get("studies", {}).items()
               if configs is None or study["configuration"] in configs}
    if studies:
        keys = list(studies)
        names = list(dict.fromkeys(name for key in keys for name in studies[key]["mean_gap_percent"]))
        lines += ["| variant | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for name in names:
            cells = []
            for key in keys:
                study = studies[key]
                if name not in study["mean_gap_percent"]:
                    cells.append("")
                    continue
                error = study.get("stderr_percent", {}).get(name)
                seeds = len(study["gaps_percent"][name])
                cells.append(f"{study['mean_gap_percent'][name]:+.2f}"
                             + ("" if error is None else f" ± {error:.2f}") + f" ({seeds})")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        spread = []
        for key in keys:
            base = list(studies[key]["losses"].get(BASELINE, {}).values())
            spread.append(f"{100 * (max(base) - min(base)) / min(base):.2f}" if len(base) > 1 else "")
        lines.append("| O0 seed spread (max-min, %) | " + " | ".join(spread) + " |")
    probes = data.get("gradient_error", {})
    if probes:  # one column per configuration, each cell the mean over its seeds
        by_config: dict[str, list[dict[str, Any]]] = {}
        for key, probe in probes.items():
            by_config.setdefault(key.split(" seed=")[0], []).append(probe)
        lines += ["", "SQNR against FP32 in dB (mean over seeds): weight gradients of the FP8 layers "
                  "(mean / worst layer), position-embedding gradient", "",
                  "| variant | " + " | ".join(by_config) + " |", "|---" * (len(by_config) + 1) + "|"]
        names = list(dict.fromkeys(name for probe in probes.values() for name in probe))
        for name in names:
            cells = []
            for runs in by_config.values():
                rows = [run[name] for run in runs if name in run]
                mean = {key: statistics.fmean(row[key] for row in rows) for key in
                        ("weight_grad_sqnr_db", "worst_layer_sqnr_db", "position_grad_sqnr_db")} if rows else None
                cells.append("" if mean is None else f"{mean['weight_grad_sqnr_db']:.1f} / "
                             f"{mean['worst_layer_sqnr_db']:.1f} / {mean['position_grad_sqnr_db']:.1f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["docs-lr0.003"],
                        help=f"configurations, 'targets' or 'all' (choices: {', '.join(CONFIGS)})")
    parser.add_argument("--variants", nargs="+", default=["before"],
                        help=f"variants or groups ({', '.join(GROUPS)}); choices: {', '.join(VARIANTS)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=BASE.steps)
    parser.add_argument("--tag", default="", help="keep these runs apart from the untagged study of each configuration")
    parser.add_argument("--gradients", action="store_true",
                        help="measure one step's gradient error per variant instead of training runs")
    parser.add_argument("--table", action="store_true",
                        help="print the recorded results as markdown and exit (of --configs only, when given)")
    args = parser.parse_args()
    configs = {"all": list(CONFIGS), "targets": list(TARGET_CONFIGS), "realistic": list(REALISTIC_CONFIGS)}.get(" ".join(args.configs), args.configs)
    if args.table:
        path = _path(torch.device(BASE.device))
        chosen = None if args.configs == parser.get_default("configs") else configs
        print(markdown(json.loads(path.read_text()), chosen) if path.is_file() else f"{path} does not exist yet")
        return
    variants = [name for item in args.variants for name in GROUPS.get(item, (item,))]
    unknown = [name for name in configs if name not in CONFIGS] + [name for name in variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown configurations or variants {unknown}")
    if args.gradients:
        measure_gradients(configs, variants, args.seeds)
    else:
        run(configs, variants, args.seeds, args.steps, args.tag)


def measure_gradients(configs: list[str], variants: list[str], seeds: list[int],
                      train_steps: int = 100, batches: int = 4) -> None:
    """Run ``gradient_error`` per configuration and seed, print it, merge it into the JSON."""
    console = default_console()
    device = torch.device(BASE.device)
    path = _path(device)
    previous = json.loads(path.read_text()) if path.is_file() else {"studies": {}}
    probes = previous.setdefault("gradient_error", {})
    for config_name in configs:
        for seed in seeds:
            probe = gradient_error(config_name, variants, train_steps, batches, seed)
            probes.setdefault(f"{config_name} after={train_steps} seed={seed}", {}).update(probe["variants"])
            for name, row in probe["variants"].items():
                console.print(f"{config_name} seed {seed} {name:20s} wgrad {row['weight_grad_sqnr_db']:5.1f} dB "
                              f"(worst {row['worst_layer_sqnr_db']:5.1f}), pos grad {row['position_grad_sqnr_db']:5.1f} dB, "
                              f"loss {row['loss_relative_error_percent']:.3f}%", highlight=False)
        _write(device, gradient_error=probes)


_PER_RUN = ("losses", "train_losses", "skipped_steps", "wall_s")


def _save_study(device: torch.device, key: str, study: dict[str, Any]) -> None:
    """Merge one study's runs into the JSON, under a file lock, keeping what other
    processes running other configurations (or seeds) wrote."""
    path = _path(device)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        studies = json.loads(path.read_text()).get("studies", {}) if path.is_file() else {}
        merged = studies.setdefault(key, {})
        for field, value in study.items():
            if field in _PER_RUN:
                for name, runs in value.items():
                    merged.setdefault(field, {}).setdefault(name, {}).update(runs)
            elif field == "variants":
                merged.setdefault(field, {}).update(value)
            else:
                merged[field] = value
        summarize(merged)
        _write(device, studies=studies)


def _write(device: torch.device, **sections: Any) -> None:
    """Merge ``sections`` into the JSON, keeping the sections other runs wrote."""
    path = _path(device)
    data = json.loads(path.read_text()) if path.is_file() else {}
    kept = {key: data[key] for key in ("studies", "gradient_error") if key in data}
    write_result(NAME, device, {"method": __doc__.split("\n\n")[2].replace("\n", " "), **kept, **sections}, RESULTS)


if __name__ == "__main__":
    main()
