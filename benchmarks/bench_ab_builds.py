"""In-model A/B of two builds of the native CPU kernels: the fused decode attention of build A and of build B take
turns step by step in one process (SmolLM2-135M fp32, or with ``--model`` the first ``--layers`` layers of a public
model shape with random weights, e.g. ``llama-3.2-3b``; default ``KiviCache`` over a random history of ``--context``
tokens), and each step's op time per layer call and step time are paired with the other build's. Prints the medians
and the median of the per-pair ratios A/B (above 1: B faster). What it measures is a kernel change where it matters:
the history read cold between the model's weights, which a loop over one layer (warm caches) does not show, and runs
of one build after the other cannot tell apart on a shared VM whose speed drifts by 30 % within minutes.

Each build is compiled from ``csrc/cpu`` of a git revision (or of the working tree, ``-``) with the flags of setup.py,
under a module name of its own (``torch.utils.cpp_extension.load``, which needs ``ninja``: ``pip install ninja``):
Python hands back the first module for a second import of the same name, whatever the file, so two copies of
``kivi_xpu._cpu`` cannot be loaded side by side. Builds are cached by the hash of their sources. The cache's own
update (``append_decode_step``) runs the installed extension in both arms; only the attention op differs.

    python benchmarks/bench_ab_builds.py --a HEAD --b - --batch 4 --context 8064
    python benchmarks/bench_ab_builds.py --a HEAD~3 --b HEAD --batch 1 --context 1024 --steps 80
    python benchmarks/bench_ab_builds.py --a HEAD --b - --model llama-3.2-3b --layers 4 --batch 4 --context 8192
"""

from __future__ import annotations

import argparse
import hashlib
import io
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load
from transformers import AutoModelForCausalLM

from kivi_xpu import KiviCache, assets
from kivi_xpu.attention import functions as kivi_attention
from kivi_xpu.cache import config_head_dim
from kivi_xpu.integration import cache_argument
from kivi_xpu.ops.operands import decode_args
from kivi_xpu.tools.machine import lscpu_lines
from kivi_xpu.tools.shapes import SHAPES, shape_model

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["-O3", "-g0", "-std=c++17", "-fopenmp"]  # setup.py: native_cpu_extension


def sources_of(revision: str) -> dict[str, bytes]:
    """csrc/cpu of a git revision, or of the working tree for ``-``: {file name: contents}."""
    if revision == "-":
        return {p.name: p.read_bytes() for p in sorted((ROOT / "csrc" / "cpu").iterdir()) if p.is_file()}
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", revision, "csrc/cpu"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {Path(m.name).name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def build(revision: str, label: str):
    """The native extension of ``revision`` as module ``kivi_ab_<label>_<hash>`` (compiled once per source hash)."""
    files = sources_of(revision)
    digest = hashlib.sha256(b"".join(name.encode() + data for name, data in sorted(files.items()))).hexdigest()[:12]
    directory = Path(tempfile.gettempdir()) / "kivi_xpu_ab_builds" / digest
    (directory / "src").mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        target = directory / "src" / name
        if not target.exists() or target.read_bytes() != data:
            target.write_bytes(data)
    sources = sorted(str(p) for p in (directory / "src").glob("*.cpp"))
    print(f"build {label} = {revision} (sources {digest}) ...", flush=True)
    return load(
        name=f"kivi_ab_{label}_{digest}",
        sources=sources,
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default="HEAD", help="git revision of build A, or - for the working tree (default HEAD)")
    p.add_argument("--b", default="-", help="git revision of build B, or - for the working tree (default -)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=8064)
    p.add_argument("--steps", type=int, default=40, help="step pairs timed (after 2 untimed)")
    p.add_argument("--model", choices=["smollm2", *SHAPES], default="smollm2", help="the model (default smollm2)")
    p.add_argument("--layers", type=int, help="decoder layers of a --model shape (default 4)")
    args = p.parse_args()
    if args.layers is not None and args.model == "smollm2":
        p.error(f"--layers builds part of a public shape: --model must be one of {', '.join(SHAPES)}")
    print(*lscpu_lines(), sep="\n")
    builds = {"A": build(args.a, "a"), "B": build(args.b, "b")}
    print(f"ISA: {builds['A'].isa()} / {builds['B'].isa()}, arithmetic {builds['A'].dot()} / {builds['B'].dot()}, "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip

    torch.manual_seed(0)
    if args.model == "smollm2":
        model = AutoModelForCausalLM.from_pretrained(assets.smollm2_checkpoint(), dtype=torch.float32).eval()
    else:
        model = shape_model(args.model, torch.float32, "cpu", args.context + args.steps + 4, args.layers or 4)
    model.set_attn_implementation("kivi")
    cfg, b, n = model.config, args.batch, args.context
    cache = KiviCache(config=cfg)
    head_dim = config_head_dim(cfg)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(b, cfg.num_key_value_heads, n, head_dim)
        cache.update(k, torch.randn_like(k), layer, {"cache_position": torch.arange(n)})

    arm, op_seconds = ["A"], []

    def decode_attention(inputs, query, mask, scaling, softcap):  # attention.functions.decode_attention, by build
        operands = decode_args(inputs.keys, inputs.values, mask, scaling, 0.0 if softcap is None else float(softcap))
        start = time.perf_counter()
        out = builds[arm[0]].decode_attention(query, *operands)
        op_seconds.append(time.perf_counter() - start)
        return out.to(query.dtype)

    kivi_attention.decode_attention = decode_attention
    token = torch.randint(0, cfg.vocab_size, (b, 1))
    times = {name: {"op": [], "step": []} for name in builds}
    ratios = {"op": [], "step": []}
    with torch.no_grad():
        for step in range(args.steps + 2):
            pair = {}
            for name in ("A", "B") if step % 2 else ("B", "A"):
                arm[0] = name
                op_seconds.clear()
                position = torch.tensor([n + step])
                start = time.perf_counter()
                model(input_ids=token, **cache_argument(cache), cache_position=position,
                      position_ids=position.expand(b, 1))  # fmt: skip
                pair[name] = {"op": statistics.median(op_seconds), "step": time.perf_counter() - start}
                cache.crop(-1)  # both builds step from the same history
            if step < 2:
                continue
            for what in ratios:
                for name in builds:
                    times[name][what].append(pair[name][what])
                ratios[what].append(pair["A"][what] / pair["B"][what])
    print(f"{args.model}, batch {b}, context {n}, {args.steps} step pairs; A = {args.a}, B = {args.b}")
    for what, label in (("op", "op ms per layer call"), ("step", "step ms")):
        a, bb = (statistics.median(times[name][what]) * 1e3 for name in builds)
        q = statistics.quantiles(ratios[what], n=4)
        print(f"  {label}: A {a:.3f}, B {bb:.3f}; A/B per pair: median {statistics.median(ratios[what]):.3f} "
              f"(quartiles {q[0]:.3f}-{q[2]:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
