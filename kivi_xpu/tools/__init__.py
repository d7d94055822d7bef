"""The command-line tools: ``kivi-xpu bench`` (:mod:`.bench`) and ``kivi-xpu eval-ppl`` (:mod:`.eval_ppl`).

One concern per module: :mod:`.options` (the settings a run takes, as dataclasses), :mod:`.cli` (argparse and
process plumbing shared by both tools), :mod:`.specs` (which caches run and how they are built), :mod:`.loading`
(models and texts), :mod:`.memory` (KV bytes and peak resident set), :mod:`.machine` (the environment a result
was measured in), :mod:`.timing` (timed decode, ``--contend`` processes, step ratios), :mod:`.workload` (what the
bench modes share: their options, model and prompts), :mod:`.curve` (``bench --curve``), :mod:`.budget` (``bench
--kv-budget``), :mod:`.io` (atomic JSON/PNG writing), :mod:`.report` (tables), :mod:`.plots` (figures).
Library functions take the options dataclasses; only :mod:`.cli` and the tools' ``main`` see argparse.
"""
