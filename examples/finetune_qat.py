"""Quantization-aware fine-tuning for a KIVI cache: train a model on the noise its deployment cache will add.

python examples/finetune_qat.py                    # tiny byte-level Llama on a built-in text, offline
python examples/finetune_qat.py --text FILE        # the same on your own text (UTF-8)
python examples/finetune_qat.py --smollm2 --text wikipedia --steps 20   # SmolLM2-135M (slow on a CPU)
python examples/finetune_qat.py --smollm2 --device xpu --dtype bfloat16  # where and how the model runs (not measured)

The tiny default: a byte-level Llama is first trained in full precision on the text (``--pretrain-steps``), then
fine-tuned for ``--steps`` more steps in two ways from the same starting point: plain full-precision training, and
the QAT forward (``kivi_xpu.qat.kivi_qat``), which applies exactly the quantize-dequantize a token-by-token decode
with ``KiviCache`` applies. Both are scored by a real token-by-token decode of windows of the text into a
``KiviCache`` and into a full-precision ``DynamicCache`` (teacher forcing, every prediction after a window's first
token scored). The evaluation windows are the end of the text; they are also trained on unless ``--held-out``
(the default for --smollm2): the built-in text is far too small for a tiny model to generalise from, so the
default demonstrates how QAT changes what the model does under its cache, not generalisation. The KIVI default is
deliberately harsh (2-bit, G=16, R=16) so that most of a 128-token window is read quantized.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from common import DTYPES, check_device
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kivi_xpu import KiviCache
from kivi_xpu.integration import cache_argument
from kivi_xpu.qat import kivi_qat

# An original text written for this example (free to use); a small model learns its spelling and word patterns.
BUILT_IN_TEXT = """\
The lighthouse keeper wrote in the log every evening. She wrote the date, the wind, the height of the waves and the \
names of the ships that passed. On calm nights the log was short: wind light from the west, sea slight, two fishing \
boats going north. On stormy nights the log was long, and the handwriting leaned like the grass on the cliff.
The keeper had a brother who lived in the town below the cliff. He repaired clocks. Every Sunday he climbed the path \
to the lighthouse with a basket of bread, a jar of honey and a clock that needed a second opinion. They sat at the \
small table under the lamp room and listened to the clock while the kettle boiled. The keeper said that a clock and \
a lighthouse do the same work: one keeps the time and the other keeps the ships, and both must never stop.
In the spring the ships came back from the south. The keeper counted them: the grey steamer with the red funnel, the \
two white schooners, the ferry that crossed to the island twice a day, and the slow barge that carried stone from \
the quarry. She knew each one by its lights. A green light over a white light meant a ship going away from her; a \
red light over a white light meant a ship coming towards her.
One night in autumn the lamp went out. The wind was strong from the north and the rain came sideways through the \
broken pane. The keeper climbed the stairs with a candle, cleaned the burner, trimmed the wick and lit the lamp \
again. It took eleven minutes. In the log she wrote: lamp out eleven minutes, wind strong from the north, sea rough, \
no ships in sight. Then she wrote a second line: no ships in sight, but a ship may have seen us.
On Sunday her brother brought a clock that had stopped at eleven minutes past nine. He said that he could not find \
anything wrong with it. The keeper looked at the clock for a long time. Then she wound it, set it to the right \
time, and put it on the shelf beside the log, where it has kept the time ever since.
In winter the days were short and the lamp burned from four in the afternoon until eight in the morning. The keeper \
carried oil up the stairs in the evening and carried the empty cans down in the morning. She polished the lens on \
Mondays, painted the railings on Wednesdays when the weather allowed, and on Fridays she wrote letters to the \
harbour master about the state of the path, the price of oil and the broken pane, which nobody came to repair.
The brother grew old and stopped climbing the path. The keeper walked down to the town on Sundays instead, with \
the basket, the bread and the honey, and they listened to his clocks in the small shop that smelled of oil and \
brass. When the harbour master finally sent a man to repair the pane, the keeper wrote in the log: pane repaired, \
wind light from the west, sea slight, two fishing boats going north.
"""


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", help="UTF-8 text file to train and evaluate on (default: a built-in text); with "
                   "--smollm2 also 'wikipedia' (kivi_xpu.assets.wikipedia_text)")  # fmt: skip
    p.add_argument("--smollm2", action="store_true", help="fine-tune SmolLM2-135M-Instruct instead of a tiny model")
    p.add_argument("--device", default="cpu", help="where the model trains and decodes: cpu (default), xpu, cuda, "
                   "... (the evaluation caches use the pure-PyTorch kernels, which run on any device)")  # fmt: skip
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="model dtype (default float32)")
    p.add_argument("--pretrain-steps", type=int, default=250, help="tiny model: full-precision steps first (250)")
    p.add_argument("--steps", type=int, default=60, help="fine-tuning steps, QAT and full precision each (60)")
    p.add_argument("--lr", type=float, default=None, help="fine-tuning learning rate (tiny: 1e-3; SmolLM2: 1e-5)")
    p.add_argument("--window", type=positive_int, default=128, help="tokens per training/evaluation window (128)")
    p.add_argument("--batch", type=positive_int, default=8, help="training windows per step (8)")
    p.add_argument("--eval-windows", type=positive_int, default=8, help="windows scored by the streaming decode (8)")
    p.add_argument("--held-out", action="store_true", help="do not train on the evaluation windows")
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--residual-length", type=int, default=16)
    p.add_argument("--sink-tokens", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (tiny model: 1, which is fastest)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,  # bytes
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config)


def load(args):
    """(model on ``--device`` in ``--dtype``, token ids of the text as a 1-D tensor on the CPU)."""
    device, dtype = check_device(args.device), DTYPES[args.dtype]
    if not args.smollm2:
        path = Path(args.text) if args.text else None
        text = path.read_text(encoding="utf-8") if path else BUILT_IN_TEXT
        model = tiny_model(args.seed).to(device, dtype)
        return model, torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kivi_xpu.assets import smollm2_checkpoint, wikipedia_text

    checkpoint = smollm2_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, device_map=device)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    path = wikipedia_text() if args.text in (None, "wikipedia") else Path(args.text)
    text = path.read_text(encoding="utf-8")[:200_000]
    return model, torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def split(tokens: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(training tokens, evaluation windows [W, window]): the evaluation windows are the end of the text, left out of
    the training tokens with ``--held-out``."""
    evaluated = args.eval_windows * args.window
    needed = evaluated + 2 * args.window if args.held_out else max(evaluated, 2 * args.window)
    if len(tokens) < needed:
        sys.exit(f"error: the text has {len(tokens)} tokens; need at least {needed} "
                 "(--eval-windows, --window and --held-out set how many)")  # fmt: skip
    windows = tokens[len(tokens) - evaluated :].reshape(args.eval_windows, args.window)
    return (tokens[:-evaluated] if args.held_out else tokens), windows


def train(model, tokens: torch.Tensor, steps: int, lr: float, args, qat_options=None) -> None:
    """``steps`` of AdamW on random windows of ``tokens``; the QAT forward when ``qat_options`` is given."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed + 1)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - args.window, (args.batch,), generator=generator)
        batch = torch.stack([tokens[s : s + args.window] for s in starts.tolist()]).to(model.device)
        if qat_options is None:
            loss = model(batch, labels=batch, use_cache=False).loss
        else:
            with kivi_qat(model, **qat_options):
                loss = model(batch, labels=batch, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


@torch.no_grad()
def streaming_ppl(model, windows: torch.Tensor, make_cache) -> float:
    """Perplexity of a token-by-token decode of ``windows [W, n]`` into ``make_cache()`` (teacher forcing; the
    predictions of tokens 1..n-1 are scored)."""
    cache, nll = make_cache(), 0.0
    for t in range(windows.shape[1] - 1):
        logits = model(windows[:, t : t + 1], **cache_argument(cache), use_cache=True).logits[:, -1]
        nll += F.cross_entropy(logits.float(), windows[:, t + 1], reduction="sum").item()
    return math.exp(nll / (windows.shape[0] * (windows.shape[1] - 1)))


@torch.no_grad()
def qat_forward_ppl(model, windows: torch.Tensor, qat_options) -> float:
    """The same quantity from one QAT forward (it equals the streaming decode up to float rounding)."""
    with kivi_qat(model, **qat_options):
        return math.exp(model(windows, labels=windows, use_cache=False).loss.item())


def main(argv=None) -> int:
    args = parse_args(argv)
    args.held_out = args.held_out or args.smollm2
    if args.threads or not args.smollm2:
        torch.set_num_threads(args.threads or 1)
    qat_options = dict(bits=args.bits, group_size=args.group_size, residual_length=args.residual_length,
                       sink_tokens=args.sink_tokens)  # fmt: skip
    model, tokens = load(args)
    train_tokens, eval_windows = split(tokens, args)
    eval_windows = eval_windows.to(model.device)
    # Validates the options against the model (head_dim, sinks < R, ...) before any training.
    KiviCache(config=model.config, backend="reference", **qat_options)

    def kivi_cache():
        return KiviCache(config=model.config, backend="reference", **qat_options)

    def fp_cache():
        return DynamicCache(config=model.config)

    describe = ", ".join(f"{k}={v}" for k, v in qat_options.items())
    where = "held out from training" if args.held_out else "also trained on"
    print(f"text: {len(train_tokens)} training tokens; evaluation: the last {eval_windows.shape[0]} windows of "
          f"{args.window} tokens ({where}); KIVI cache: {describe}")  # fmt: skip
    if not args.smollm2:
        train(model, train_tokens, args.pretrain_steps, 3e-3, args)
        print(f"full-precision pre-training: {args.pretrain_steps} steps")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    before_fp, before_kivi = (
        streaming_ppl(model, eval_windows, fp_cache),
        streaming_ppl(model, eval_windows, kivi_cache),
    )
    print(f"start:                           streaming ppl full precision {before_fp:8.3f}   KIVI {before_kivi:8.3f}")
    lr = args.lr or (1e-5 if args.smollm2 else 1e-3)
    results = {}
    for name, options in (("full-precision fine-tuning", None), ("QAT fine-tuning", qat_options)):
        model.load_state_dict(start)
        train(model, train_tokens, args.steps, lr, args, options)
        results[name] = streaming_ppl(model, eval_windows, fp_cache), streaming_ppl(model, eval_windows, kivi_cache)
        fp, kivi = results[name]
        print(f"+{args.steps} steps {name + ':':27s} streaming ppl full precision {fp:8.3f}   KIVI {kivi:8.3f}")
    qat_check = qat_forward_ppl(model, eval_windows, qat_options)
    print(f"(the QAT forward's own ppl on the same windows: {qat_check:.3f}; it equals the streaming KIVI ppl up to "
          "float rounding)")  # fmt: skip
    after = results["QAT fine-tuning"][1]
    print(f"streaming ppl with KIVI cache: before {before_kivi:.3f} -> after {after:.3f} "
          f"(full-precision fine-tuning instead: {results['full-precision fine-tuning'][1]:.3f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
