"""Writing results: JSON and PNG files appear only complete (a temporary file renamed into place)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from .options import ToolError


def check_output_path(path: str | None, option: str) -> None:
    """Fails before any measurement when the directory of an output file does not exist."""
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise ToolError(f"{option} {path!r}: directory {str(Path(path).resolve().parent)!r} does not exist")


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """Calls ``write(temporary_path)`` and renames the result to ``path``: a reader never sees a partial file."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        write(str(temporary))
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def write_json(path: str, payload: dict) -> None:
    def write(temporary: str) -> None:
        with open(temporary, "w") as f:
            json.dump(payload, f, indent=2, default=str)
            f.write("\n")

    write_atomically(path, write)


def write_png(path: str, figure) -> None:
    """Saves a matplotlib figure as a PNG at ``path`` and closes it."""
    import matplotlib.pyplot as plt

    write_atomically(path, lambda temporary: figure.savefig(temporary, format="png", dpi=110))
    plt.close(figure)
