"""One scheduler for prefill and decode alike: a per-step token budget.

Each step hands out at most `max_num_batched_tokens` tokens as
{request_id: num_tokens}. Running requests go first (a decode takes one
token, an unfinished prefill takes its next chunk), so a started prefill finishes before a new
one starts; then waiting requests are admitted, in the order of the scheduling policy
(engine/prefill_order.py: fcfs, priority or sjf), with their prefix-cache hits applied. When blocks run
out, the most recently admitted running request is preempted by recompute: its
blocks are freed and it goes back to the front of the waiting queue.

Async scheduling (``schedule(async_step=True)``, docs/engine.md "Async scheduling"): step N+1 is
scheduled while step N still runs. Progress then advances at schedule time, and a request that
samples in a step holds an output placeholder until the step's token is applied
(``update_from_async_output``): placeholders count against max_tokens and the model length, and
never reach the prefix cache (only known tokens are hashed). An async schedule never preempts:
when blocks run out it stops and marks the output ``blocked`` (the engine drains the pipeline
and takes a synchronous step, which may preempt). A request that ends while a step that holds
it is in flight keeps its blocks until that step is released.

LoRA (``max_loras`` > 0): the running requests hold at most ``max_loras`` distinct adapters, so no
step holds more. A waiting request whose adapter would be one too many stays queued, in its place,
while base requests and requests of adapters already running are admitted past it (as vLLM's).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.prefill_order import DEFAULT_MAX_SKIPS, PrefillOrder
from kvmesh.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests in the order they run this step (running first, then new).
    requests: list[Request] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Async steps only: each request's num_computed_tokens when scheduled (its first position this
    # step), its preemption count then (a request reset since is stale), the requests admitted
    # from the waiting queue this step, and whether blocks ran out (a sync step must follow).
    starts: dict[str, int] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)
    admitted: list[str] = field(default_factory=list)
    sampling: set[str] = field(default_factory=set)
    blocked: bool = False
    is_async: bool = False

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        max_loras: int = 0,
        policy: str = "fcfs",
        max_prefill_skips: int = DEFAULT_MAX_SKIPS,
    ):
        self.kv = kv
        self.order = PrefillOrder(policy, max_prefill_skips)
        self.max_loras = max_loras  # distinct adapters among the running requests; 0: no LoRA
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Async scheduling: how many in-flight steps hold each request, and the ended requests
        # whose blocks wait for those steps to be released.
        self.in_flight: dict[str, int] = {}
        self._deferred_free: dict[str, Request] = {}
        # Called with each request that ends (any status), once: the engine's adapter refcounts.
        self.on_finish: Callable[[Request], None] | None = None

    # -- queue management ------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, stop string) wherever it is and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._remove(request)
        request.status = status
        self._free(request)
        if self.on_finish is not None:
            self.on_finish(request)
        return request

    def _free(self, request: Request) -> None:
        """Free a finished request's blocks, or, while a step that holds it is in flight, once
        that step is released (it still writes the request's slots)."""
        if self.in_flight.get(request.request_id):
            self._deferred_free[request.request_id] = request
        else:
            self.kv.free(request)

    def release(self, out: SchedulerOutput, request_ids) -> None:
        """An async step is done with these requests (applied or reverted): free the blocks of
        those that ended meanwhile and are held by no other in-flight step."""
        for rid in request_ids:
            n = self.in_flight.get(rid, 0) - 1
            if n > 0:
                self.in_flight[rid] = n
                continue
            self.in_flight.pop(rid, None)
            req = self._deferred_free.pop(rid, None)
            if req is not None:
                self.kv.free(req)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def release_all(self) -> None:
        """No step is in flight any more (the engine's last-resort failure path): free every
        deferred request's blocks."""
        self.in_flight.clear()
        for req in self._deferred_free.values():
            self.kv.free(req)
        self._deferred_free.clear()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass

    def requeue(self, request: Request) -> None:
        """Send a running request back to the front of the queue to recompute from scratch (its
        step's results were discarded: it read KV that a failed request never wrote)."""
        self.running.remove(request)
        self._preempt(request)

    # -- one step ----------------------------------------------------------------
    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self, async_step: bool = False) -> SchedulerOutput:
        out = SchedulerOutput(is_async=async_step)
        budget = self.max_num_batched_tokens

        # 1. Running requests, oldest first; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            pending = request.num_output_placeholders
            if pending and request.num_output_tokens + pending >= request.max_output_tokens:
                i += 1  # its last token is in flight: nothing past max_tokens / the model length
                continue
            num_new = min(
                request.num_tokens + pending - request.num_computed_tokens,
                budget,
                self.max_model_len - request.num_computed_tokens,
            )
            if num_new <= 0:
                i += 1
                continue
            if (
                request.spec_token_ids
            ):  # drafts ride along with a decode, as far as the budget allows
                room = min(budget, self.max_model_len - request.num_computed_tokens) - num_new
                request.spec_token_ids = (
                    request.spec_token_ids[:room] if num_new == 1 and room > 0 else []
                )
                num_new += len(request.spec_token_ids)
            scheduled = True
            while self.kv.allocate_slots(request, num_new) is None:
                if request.spec_token_ids:  # drafts never cost a preemption: drop them first
                    num_new -= len(request.spec_token_ids)
                    request.spec_token_ids = []
                    continue
                if async_step:  # never preempt while a step is in flight: a sync step will
                    out.blocked = True
                    scheduled = False
                    break
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                break
            out.num_scheduled_tokens[request.request_id] = num_new
            out.requests.append(request)
            if async_step:
                self._advance(out, request, num_new)
            budget -= num_new
            i += 1

        # 2. Waiting requests, in the policy's order; none are admitted in a step that had to
        # preempt. A request whose grammar is still compiling, or whose adapter has no slot, stays
        # queued, in its place, and the ones behind it go on.
        if not out.preempted and not out.blocked:
            self._admit(out, budget, async_step)
        return out

    def _admit(self, out: SchedulerOutput, budget: int, async_step: bool) -> None:
        """Admit waiting requests while budget, sequence slots and blocks last."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return
        slots = self._adapter_slots()
        ranked, i = self.order.order(self.waiting, self.kv), 0
        while i < len(ranked):
            request, i = ranked[i], i + 1
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if request.structured is not None and request.structured.compiling:
                continue
            if not self._has_slot(request, slots):
                continue
            computed_blocks, num_computed = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break  # the whole prompt must fit one step; wait for budget
                num_new = budget
            if self.kv.allocate_slots(request, num_new, computed_blocks) is None:
                break
            pos = self.waiting.index(request)
            del self.waiting[pos]
            if self.order.passed_over(list(itertools.islice(self.waiting, pos))):
                ranked, i = self.order.order(self.waiting, self.kv), 0  # one aged: it goes next
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora is not None:
                slots.add(id(request.lora))
            out.num_scheduled_tokens[request.request_id] = num_new
            out.requests.append(request)
            if async_step:
                out.admitted.append(request.request_id)
                self._advance(out, request, num_new)
            budget -= num_new

    def _adapter_slots(self) -> set[int]:
        """The adapters (by object: a name reloaded with new files is another adapter) that the
        running requests hold."""
        return {id(r.lora) for r in self.running if r.lora is not None}

    def _has_slot(self, request: Request, slots: set[int]) -> bool:
        """Whether admitting the request keeps the running adapters within max_loras."""
        lora = request.lora
        if lora is None or not self.max_loras or id(lora) in slots:
            return True
        return len(slots) < self.max_loras

    def _advance(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        """Async step: progress moves at schedule time; a request that samples holds a placeholder."""
        rid = request.request_id
        out.starts[rid] = start = request.num_computed_tokens
        out.epochs[rid] = request.num_preemptions
        if start + num_new >= request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1
            out.sampling.add(rid)
        request.num_computed_tokens = start + num_new
        self.in_flight[rid] = self.in_flight.get(rid, 0) + 1

    def unschedule(self, out: SchedulerOutput) -> list[Request]:
        """Undo an async step that will not be applied (an earlier step failed): progress and
        placeholders go back; requests it admitted go back to the queue to recompute from scratch
        (they may hold prefix hits on KV that the failed step never wrote). Returns those."""
        readmit = []
        for request in reversed(out.requests):
            rid = request.request_id
            if self.requests.get(rid) is not request or request.num_preemptions != out.epochs[rid]:
                continue  # ended, or reset since
            if rid in out.admitted:
                readmit.append(request)
                continue
            if rid in out.sampling:
                request.num_output_placeholders -= 1
            request.num_computed_tokens = out.starts[rid]
        for request in readmit:  # reversed order: the first admitted ends up first in the queue
            self.running.remove(request)
            self._preempt(request)
            self.num_preemptions -= 1  # not a preemption for lack of blocks
        return readmit

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int]
    ) -> list[tuple[Request, int | None]]:
        """Advance progress; append sampled tokens; finish what stopped.

        Returns (request, new_token or None) for each request that produced a token.
        """
        results: list[tuple[Request, int | None]] = []
        for request in out.requests:
            if request.request_id not in self.requests:
                continue  # aborted during the step
            token = sampled.get(request.request_id)
            if isinstance(token, list):  # verified drafts: the accepted ones, then one more
                results.append((request, self._update_spec(request, out, token)))
                continue
            request.num_computed_tokens += out.num_scheduled_tokens[request.request_id]
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            self._append(request, token)
            results.append((request, token))
        return results

    def _append(self, request: Request, token: int) -> bool:
        """Append one sampled token; a request that it stops is finished and its KV freed.
        Returns whether it stopped."""
        request.append_token(token)
        status = request.check_stop()
        if status is None:
            return False
        self.finish_request(request.request_id, status)
        return True

    def update_from_async_output(
        self, out: SchedulerOutput, sampled: dict[str, int]
    ) -> list[tuple[Request, int]]:
        """Apply an async step's sampled tokens (progress moved at schedule time): each fills its
        request's placeholder, with the usual stop checks. A request that ended meanwhile (abort,
        stop) gets nothing; one preempted since keeps its token (sampled from its complete KV) and
        recomputes. Blocks that the token completes enter the prefix cache now that it is known."""
        results: list[tuple[Request, int]] = []
        for request in out.requests:
            rid = request.request_id
            if self.requests.get(rid) is not request:
                continue  # ended during the step
            token = sampled.get(rid)
            if token is None:
                continue
            stale = request.num_preemptions != out.epochs[rid]
            if not stale:
                request.num_output_placeholders -= 1
            if not self._append(request, token) and not stale:
                self.kv.cache_computed(request)
            results.append((request, token))
        return results

    def _update_spec(self, request: Request, out: SchedulerOutput, tokens: list[int]) -> list[int]:
        """A step that verified drafts: keep the KV of the accepted ones, release the rejected tail's
        slots, append tokens one by one with the usual stop checks (a stop inside the accepted run
        ends the request there). Returns the tokens kept."""
        n = out.num_scheduled_tokens[request.request_id]
        num_drafts = request.num_computed_tokens + n - request.num_tokens
        num_rejected = num_drafts - (len(tokens) - 1)
        request.num_computed_tokens += n - num_rejected
        request.spec_token_ids = []
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            if self._append(request, token):
                return kept
        self.kv.release_lookahead(request)
        return kept
