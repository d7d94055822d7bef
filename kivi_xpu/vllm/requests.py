"""What each request of one vLLM worker holds besides its blocks: its exact units, as the scheduler's ledger lent
them for this step (:mod:`.ledger`).

vLLM's scheduler lends the blocks (2-bit pages) and names them in each row of the block table; the attention backend
sees rows, not requests. The model runner knows which request each row is (``input_batch.req_ids``):
:class:`WorkerRequests` reads that, and the step's :class:`~kivi_xpu.vllm.ledger.StepUnits` that came with the
scheduler's output, once per forward, and turns each row into the core's requests
(:class:`~kivi_xpu.paged.store.Request`).
"""

from __future__ import annotations

import torch

from ..paged.store import Request
from ..paged.windows import ExactUnits
from .ledger import StepUnits
from .plan import KiviPlan


class WorkerRequests:
    """The exact units of one worker (one rank) and this step's assignments of them."""

    def __init__(self, plan: KiviPlan, device: torch.device | None = None):
        self.plan, self.device = plan, torch.device("cpu") if device is None else device
        self.units = ExactUnits.in_blocks(plan.rows, plan.block.window_step)
        self.settings = plan.settings[0]  # the sinks and R, alike in every layer
        self.runner = None  # vLLM's model runner of this worker (set by the plugin's hook)
        self.step = StepUnits.none()
        self.layers: dict[int, tuple] = {}  # layer index -> (LayerPages, PageWriter), as the layers make them

    def add_layer(self, index: int, blocks: torch.Tensor, pages, writer) -> None:
        """Layer ``index``'s blocks (vLLM's KV tensor of the layer as bytes, ``[num_blocks, page_bytes]``): its pages
        and writer, and its units, each ``unit_blocks`` aligned blocks (:mod:`.units`)."""
        plan, (heads, head_dim, num_layers) = self.plan, self.plan.shape
        k, layer_bytes = plan.unit_blocks, plan.unit_bytes // num_layers
        if blocks.shape[1] != plan.page_bytes or not blocks.is_contiguous():
            raise RuntimeError(f"KIVI pages: vLLM's blocks are {tuple(blocks.shape)}, {plan.page_bytes} bytes each "
                               "and contiguous were planned")  # fmt: skip
        count = blocks.shape[0] // k
        both = blocks[: count * k].view(count, k * blocks.shape[1])[:, :layer_bytes].view(plan.dtype)
        self.units.add_layer(index, both.view(count, 2, heads, plan.rows, head_dim))
        self.layers[index] = (pages, writer)

    def begin_step(self, step: StepUnits | None) -> None:
        """Before a forward: the step's units (``None``: a step without requests, such as a dummy run). The pages of
        requests that ended are completed from their windows, the units lent anew start empty, and a cached prefix's
        rows are copied where a request stages after them."""
        self.step = step if step is not None else StepUnits.none()
        for flush in self.step.flushes:
            blocks = torch.tensor(flush.blocks, dtype=torch.int64)
            for layer, (pages, writer) in self.layers.items():
                writer.flush(layer, pages, flush.slot, blocks, flush.length, flush.shared_pages, flush.upto)
        self.units.reset(self.step.lent)
        for source, target, tokens in self.step.copies:
            for index in range(-(-tokens // self.plan.rows)):
                self.units.copy_rows(source[index], target[index], min(self.plan.rows, tokens - index * self.plan.rows))

    # --------------------------------------------------------------- planning

    def plan_forward(self, query_start: list[int], seq_lens: list[int], block_table: torch.Tensor) -> list[Request]:
        """The requests of this forward, in the rows' order (rows of requests the runner does not know, such as a
        dummy run's, are left out: they store and attend nothing)."""
        runner = self.runner
        ids = runner.input_batch.req_ids if runner is not None else []
        settings, tokens = self.settings, self.plan.block_tokens
        requests = []
        for row in range(len(seq_lens)):
            q_start, q_len = query_start[row], query_start[row + 1] - query_start[row]
            request_id = ids[row] if row < len(ids) else None
            state = runner.requests.get(request_id) if request_id is not None else None
            if q_len == 0 or state is None:
                continue
            held = self.step.requests.get(request_id)
            if held is None:
                raise RuntimeError(f"KIVI pages: request {request_id} is in the batch without exact units")
            past, end, prompt_len = seq_lens[row] - q_len, seq_lens[row], len(state.prompt_token_ids)
            blocks = block_table[row, : -(-end // tokens)].to(torch.int64)
            slot, shared = held.slot, held.shared_pages
            staged_end, prompt_end = min(end, held.prompt_end), min(end, prompt_len)
            if past < staged_end:  # prompt tokens attending the exact prompt (the staged chunks and these)
                staging = torch.tensor(held.staging, dtype=torch.int64, device=self.device) if held.staging else None
                requests.append(Request(request_id, slot, past, q_start, staged_end - past, blocks, held.prompt_end,
                                        staging, settings.split(past), shared, held.keep))  # fmt: skip
            start = max(past, staged_end)
            if start < prompt_end:  # prompt tokens after the staged ones (no staging units): appended
                requests.append(Request(request_id, slot, start, q_start + start - past, prompt_end - start, blocks,
                                        held.prompt_end, None, settings.split(start), shared))  # fmt: skip
            # Answer tokens: one a row, except when vLLM prefills a preempted request's answer so far again; then
            # each token is replayed, stored and attended as its decode step was.
            for position in range(max(past, prompt_end), end):
                requests.append(Request(request_id, slot, position, q_start + position - past, 1, blocks,
                                        held.prompt_end, None, settings.split(position), shared,
                                        replayed=q_len > 1))  # fmt: skip
        return requests
