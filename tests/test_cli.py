import subprocess
import sys

from trl_ppomax.cli import main


def test_presets_table(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "reward_norm" in out and "running" in out and "none" in out


def test_env_lists_versions(capsys):
    assert main(["env"]) == 0
    assert "trl:" in capsys.readouterr().out


def test_console_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "trl_ppomax.cli", "presets"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
