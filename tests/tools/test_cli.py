import subprocess
import sys

import pytest

from amp8.tools.cli import main


def test_levels_prints_the_table(capsys) -> None:
    assert main(["levels", "--verbose"]) == 0
    out = capsys.readouterr().out
    for name in ("O0", "O1", "O2", "O3"):
        assert name in out
    assert "FP16 + scale" in out and "sharded" in out
    assert "Changes nothing" in out


@pytest.mark.slow  # a fresh Python process
def test_console_script_module_runs() -> None:
    result = subprocess.run([sys.executable, "-m", "amp8.tools.cli", "levels"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "amp8 opt levels" in result.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--steps", "0"], "CompareConfig.steps=0 is not valid; use an int >= 1"),
        (["compare", "--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
        (["compare", "--batch-size", "-2"], "CompareConfig.batch_size=-2 is not valid"),
        (["compare", "--lr", "inf"], "use a finite lr > 0"),
        (["compare", "--lr", "nan"], "use a finite lr > 0"),
        (["compare", "--lr", "0"], "use a finite lr > 0"),
        (["compare", "--levels", "O0", "O5"], "'O5', not amp8 opt levels"),
        (["compare", "--seeds", "0"], "CompareConfig.seeds=0 is not valid"),
        (["compare", "--seed", "-1"], "CompareConfig.seed=-1 is not valid; use an int in [0, 2**63)"),
        (["compare", "--device", "gpu0"], "CompareConfig.device='gpu0' is not a torch device"),
        (["compare", "--max-bytes", "10"], "CorpusConfig.max_bytes=10 is not valid"),
        (["compare", "--n-embd", "20"], "not a multiple of 16"),
        (["compare", "--n-layer", "0"], "GPTConfig.n_layer=0 is not valid"),
        (["compare", "--n-head", "3"], "not divisible by n_head=3"),
        (["compare", "--block-size", "0"], "GPTConfig.block_size=0 is not valid"),
        (["compare", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["compare", "--model", "bert"], "argument --model: invalid choice: 'bert'"),
        (["compare", "--recipe", "fast"], "argument --recipe: invalid choice: 'fast'"),
        (["compare", "--out", "/proc/amp8-cannot-write-here"], "cannot be created"),
        (["levels", "--wide"], "unrecognized arguments: --wide"),
        (["explain"], "invalid choice: 'explain'"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_bad_flags_fail_with_a_clear_message(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    """Each fails while parsing or validating, before any training starts."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ("runs/compare", "runs/compare/compare.json does not exist; run `amp8 compare` first"),
        ("elsewhere", "elsewhere/compare.json does not exist; run `amp8 compare --out elsewhere` first"),
        ("elsewhere/compare.json", "run `amp8 compare --out elsewhere` first"),
        ("notes.txt", "notes.txt is not the compare.json `amp8 compare` writes"),
    ],
)
def test_report_without_a_run_says_what_to_run(
    run: str, message: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not json")
    assert main(["report", "--run", run]) == 2
    assert message in capsys.readouterr().out
