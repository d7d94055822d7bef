"""What each request of one vLLM worker holds besides its blocks: its exact units, lent from a fixed pool.

vLLM's scheduler lends the blocks (2-bit pages, :mod:`kivi_xpu.paged.pages`) and names them in each row of the
block table; the attention backend sees rows, not requests. The model runner knows which request each row is
(``input_batch.req_ids``) and which requests ended (finished, aborted, preempted): :class:`WorkerRequests` reads
both from it, once per forward, and lends each request in flight one window unit, and a prompt prefilled in several
chunks its staging units (:mod:`kivi_xpu.paged.windows`), returning them when vLLM frees or preempts the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..paged.budget import UNITS
from ..paged.store import Request
from ..paged.windows import ExactUnits
from .plan import KiviPlan

logger = logging.getLogger("vllm.kivi_xpu")  # under vLLM's logger, which has the handlers


class UnitPool:
    """A fixed free list of exact units, with the methods of transformers' ``CachePool`` that
    :class:`~kivi_xpu.paged.windows.ExactUnits` calls (all units are lent at start-up: no sectors)."""

    def __init__(self, count: int):
        self.free = list(range(count - 1, -1, -1))  # pop() lends the lowest first

    def set_blocks_per_sector(self, index: int, count: int) -> None:
        pass

    def count_free_blocks(self, index: int) -> int:
        return len(self.free)

    def allocate_sector(self, index: int) -> None:
        raise RuntimeError("KIVI exact units: the pool is exhausted (the plan bounds the requests in flight)")

    def get_free_blocks(self, index: int, count: int) -> list[int]:
        return [self.free.pop() for _ in range(count)]

    def free_blocks(self, index: int, units: list[int]) -> None:
        self.free.extend(units)


@dataclass
class Held:
    """A request's units: its window ``slot``; while its prompt is staged, ``staging`` (int64 units, in order)."""

    slot: int
    prompt_end: int
    staging: torch.Tensor | None = None


class WorkerRequests:
    """The exact units of one worker (one rank) and the requests holding them."""

    def __init__(self, plan: KiviPlan, device: torch.device | None = None):
        self.plan, self.device = plan, torch.device("cpu") if device is None else device
        self.pool = UnitPool(plan.num_units)
        tensor = torch.zeros(plan.unit_pool_bytes, dtype=torch.uint8, device=self.device)
        self.units = ExactUnits(plan, tensor, self.pool, list(range(plan.shape.num_layers)), plan.shape.heads,
                                plan.shape.head_dim, plan.dtype)  # fmt: skip
        self.held: dict[str, Held] = {}
        self.settings = plan.settings[0]  # the sinks and R, alike in every layer
        self.runner = None  # vLLM's model runner of this worker (set by the plugin's hook)
        self._staging_warned = False

    # ------------------------------------------------------------ lifecycle

    def release(self, request_ids) -> None:
        """Gives back the units of requests that vLLM finished, aborted or preempted."""
        for request_id in request_ids:
            held = self.held.pop(request_id, None)
            if held is not None:
                self._give_back(held)

    def _give_back(self, held: Held) -> None:
        units = [held.slot]
        if held.staging is not None:
            units += held.staging.tolist()
        self.units.give_back(units)

    def _admit(self, request_id: str, prompt_end: int) -> Held:
        """A request's first forward (again, after a preemption: vLLM then prefills the prompt and the answer so far
        in one go): its window unit."""
        if not self.pool.count_free_blocks(UNITS):
            raise RuntimeError(
                f"KIVI exact units: none free for request {request_id} although vLLM runs at most "
                f"{self.plan.max_requests} requests (max_num_seqs)"
            )
        held = Held(self.units.take(1)[0], prompt_end)
        self.held[request_id] = held
        return held

    def _stage(self, request_id: str, held: Held, past: int, end: int) -> None:
        """A prompt chunk ``[past, end)`` before the prompt's last: staging units for the exact prompt up to ``end``,
        taken as the chunks come, never those that the requests vLLM may still admit need for their windows. When
        none are left, this chunk ends the exact prompt: it is stored with the chunks before it as ``KiviCache``'s
        prefill of ``end`` tokens stores them, and the later chunks attend it as stored (2-bit, not exact)."""
        have = 0 if held.staging is None else held.staging.numel()
        need = -(-end // self.plan.rows) - have
        if need <= 0:
            return
        windows_to_come = self.plan.max_requests - len(self.held)
        if self.pool.count_free_blocks(UNITS) - windows_to_come >= need:
            more = torch.tensor(self.units.take(need), dtype=torch.int64, device=self.device)
            held.staging = more if held.staging is None else torch.cat([held.staging, more])
            return
        held.prompt_end = end
        if not self._staging_warned:
            self._staging_warned = True
            logger.warning(
                "KIVI pages: request %s's prompt arrives in chunks and the staging units are taken: its tokens after "
                '%d attend the earlier ones as stored (2-bit), not exact. Raise "staging_tokens" in '
                "--additional-config kivi to keep every chunked prompt exact (logged once)",
                request_id,
                end,
            )

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
            past, end, prompt_len = seq_lens[row] - q_len, seq_lens[row], len(state.prompt_token_ids)
            held = self.held.get(request_id)
            if held is None:
                if past:
                    raise RuntimeError(
                        f"KIVI pages: request {request_id} arrives with {past} tokens already computed (a prefix-cache "
                        "hit), which the plugin turns off"
                    )
                held = self._admit(request_id, prompt_len)
            if past < held.prompt_end and end < prompt_len:  # a chunk of the prompt before its last
                self._stage(request_id, held, past, end)
            if held.staging is not None and past >= held.prompt_end:  # its prompt was stored in the last forward
                self.units.give_back(held.staging.tolist())
                held.staging = None
            blocks = block_table[row, : -(-end // tokens)].to(torch.int64)
            staged_end, prompt_end = min(end, held.prompt_end), min(end, prompt_len)
            if past < staged_end:  # prompt tokens attending the exact prompt (the staged chunks and these)
                requests.append(Request(request_id, held.slot, past, q_start, staged_end - past, blocks,
                                        held.prompt_end, held.staging, settings.split(past)))  # fmt: skip
            start = max(past, staged_end)
            if start < prompt_end:  # prompt tokens after the staged ones (no staging units): appended
                requests.append(Request(request_id, held.slot, start, q_start + start - past, prompt_end - start,
                                        blocks, held.prompt_end, None, settings.split(start)))  # fmt: skip
            # Answer tokens: one a row, except when vLLM prefills a preempted request's answer so far again; then
            # each token is replayed, stored and attended as its decode step was.
            for position in range(max(past, prompt_end), end):
                requests.append(Request(request_id, held.slot, position, q_start + position - past, 1, blocks,
                                        held.prompt_end, None, settings.split(position),
                                        replayed=q_len > 1))  # fmt: skip
        return requests
