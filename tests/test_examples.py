"""The examples run (offline variants), so they cannot rot."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_generate_example_runs_offline():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "generate.py"), "--tiny", "--max-new-tokens", "24", "--residual-length", "32"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "KIVI 2-bit: 24 tokens" in result.stdout and "smaller" in result.stdout
    assert "greedy tokens identical to full precision" in result.stdout
