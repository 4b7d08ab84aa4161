import subprocess
import sys

from amp8.cli import main


def test_levels_prints_the_table(capsys) -> None:
    assert main(["levels", "--verbose"]) == 0
    out = capsys.readouterr().out
    for name in ("O0", "O1", "O2", "O3"):
        assert name in out
    assert "FP16 + scale" in out and "sharded" in out
    assert "Changes nothing" in out


def test_console_script_module_runs() -> None:
    result = subprocess.run([sys.executable, "-m", "amp8.cli", "levels"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "amp8 opt levels" in result.stdout
