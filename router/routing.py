"""Routing: a request's tokens and block keys, the pods that may take it (held while none can), and the policy's order.

A request naming a LoRA adapter goes to the pods that list it (router/adapters.py), each matched
with the block keys of the adapter's digest it lists. `discovery` is set by the router's startup.
"""

from __future__ import annotations

import asyncio
import time

from kvmesh.router import adapters
from kvmesh.router.admission import Admission
from kvmesh.router.discovery import Pod
from kvmesh.router.hold_queue import HoldQueue
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.off_loop import OFF_LOOP_CHARS, off_loop
from kvmesh.router.pod_traffic import PodTraffic
from kvmesh.router.policies import RouteRequest, RoutingPolicy
from kvmesh.router.prefix_match import PrefixMatch, Tiers, predicted_by_medium
from kvmesh.router.prompt_tokens import PromptTokens
from kvmesh.router.request_checks import Refused
from kvmesh.router.request_state import Call
from kvmesh.router.scoring import Candidate

RESUME_POLL_S = 0.25  # how often a request waiting for a replica to resume on looks again
RESUME_PROBE_S = 1.0  # how often it asks the engines that failed it whether they are back
RESUME_KEEPALIVE_S = (
    5.0  # an SSE comment this often to a stream that waits (clients ignore comments)
)


class Routing:
    def __init__(
        self,
        policy: RoutingPolicy,
        policy_name: str,
        block_size: int,
        prompt_tokens: PromptTokens,
        prefix_match: PrefixMatch,
        hold_queue: HoldQueue,
        traffic: PodTraffic,
        admission: Admission,
        metrics: RouterMetrics,
    ):
        self.policy = policy
        self.policy_name = policy_name
        self.block_size = block_size
        self.prompt_tokens = prompt_tokens
        self.prefix_match = prefix_match
        self.hold_queue = hold_queue
        self.traffic = traffic
        self.admission = admission
        self.metrics = metrics
        self.holds = False  # scale from zero is on (set by the router)
        self.discovery = None
        self.flow = None  # flow control (router/flow), set by the router when it is on

    async def route(self, call: Call, watcher: asyncio.Future) -> bool:
        """Tokens and block keys, a routable pod (held until one is: scale from zero), its turn
        while every replica is saturated (flow control), the policy's order. False if the client
        went away meanwhile; Refused if no pod came (503) or flow control refused it."""
        await self.tokenize(call)
        if watcher.done():  # gone while we tokenised
            self.client_gone(call)
            return False
        pods = await self.routable_pods(call, watcher)
        if pods is None:
            return False
        if self.flow is not None:
            if not await self.flow.wait(call, watcher):  # Refused if flow control refuses it
                self.client_gone(call)
                self.admission.refund(call)
                return False
            if call.flow is not None and call.flow.waited:  # it waited: look again
                pods = await self.routable_pods(call, watcher)
                if pods is None:
                    return False
            pods = self.flow.with_room(pods)
        await self.order(call, pods)
        return True

    def client_gone(self, call: Call) -> None:
        self.metrics.client_disconnects.inc()
        self.metrics.requests.labels(call.route, "499").inc()

    async def tokenize(self, call: Call) -> None:
        """Tokenize like the engine (long prompts off the event loop) and compute the block keys."""
        req = call.req
        call.scores_prompt = req.get("prompt_logprobs") is not None or (
            bool(req.get("echo")) and req.get("logprobs") is not None
        )
        if not call.generate:
            return
        t_tok = time.perf_counter()
        call.adapter = self.prompt_tokens.adapter(req)
        call.identity = self._identity(call, self.discovery.routable() if self.discovery else [])
        large = call.chars >= OFF_LOOP_CHARS
        args = (call.path, req, call.scores_prompt, large, call.identity)
        if large:
            call.tokens, call.keys = await off_loop(self.prompt_tokens.tokens_and_keys, *args)
        else:
            call.tokens, call.keys = self.prompt_tokens.tokens_and_keys(*args)
        self.metrics.tokenize.observe(time.perf_counter() - t_tok)
        self.admission.correct(call)

    async def routable_pods(
        self, call: Call, watcher: asyncio.Future, exclude=()
    ) -> list[Pod] | None:
        """The pods to choose from (ejected ones only if nothing else; `exclude`d ones never);
        none routable: the request is held until one is (scale from zero). None if the client
        left while held."""
        pods = self._routable(exclude)
        if self.holds and (not pods or len(self.hold_queue)):
            outcome, call.held_s, call.held = await self.hold_queue.hold(watcher)
            if outcome == "disconnect":
                self.client_gone(call)
                self.admission.refund(call)
                return None
            if outcome != "dispatched":
                raise self.hold_queue.refusal(outcome)
            pods = self._routable(exclude)
        now = time.monotonic()
        usable = [p for p in pods if not self.traffic.breaker.ejected(p.name, now)] or pods
        if not usable:
            raise Refused(
                503,
                "no ready engine for this model",
                "service_unavailable",
                code="no_ready_engine",
                headers=[(b"retry-after", b"1")],
            )
        return usable

    def resume_pods(self, exclude) -> list[Pod]:
        """The pods a failed request may go on with: routable, not `exclude`d (the ones that
        failed it), ejected ones only if nothing else. Never held: no pod left is an answer."""
        pods = self._routable(exclude)
        now = time.monotonic()
        return [p for p in pods if not self.traffic.breaker.ejected(p.name, now)] or pods

    async def resume_pods_waiting(
        self, failed: set[str], watcher: asyncio.Future, timeout: float, stopped, keep_alive, ready
    ) -> list[Pod] | None:
        """No replica to go on with: wait up to `timeout` s for one. A new pod qualifies, and so
        does one that failed this request once it is back: seen unroutable since and routable
        again, or its engine answering `await ready(pod)` (its engine restarted in place, as a
        one-replica deployment's only engine does; a view without health, static backends, never
        shows it down). Such a pod leaves `failed`. [] when none came in time (or `stopped()`),
        None when the client went away. `keep_alive()` is awaited every RESUME_KEEPALIVE_S."""
        now = time.monotonic()
        deadline, next_alive, next_probe = now + timeout, now + RESUME_KEEPALIVE_S, now
        seen_down: set[str] = set()
        while True:
            routable = self._routable(())
            seen_down |= failed - {p.name for p in routable}
            if time.monotonic() >= next_probe:
                next_probe = time.monotonic() + RESUME_PROBE_S
                for pod in routable:
                    if pod.name in failed and pod.name not in seen_down and await ready(pod):
                        seen_down.add(pod.name)
            pods = self.resume_pods(failed - seen_down)
            if pods:
                failed -= {p.name for p in pods}
                return pods
            now = time.monotonic()
            if now >= deadline or stopped():
                return []
            if now >= next_alive:
                await keep_alive()
                next_alive = now + RESUME_KEEPALIVE_S
            await asyncio.wait({watcher}, timeout=min(RESUME_POLL_S, deadline - now))
            if watcher.done():
                return None

    def _routable(self, exclude) -> list[Pod]:
        pods = self.discovery.routable()
        return [p for p in pods if p.name not in exclude] if exclude else pods

    async def order(self, call: Call, pods: list[Pod]) -> None:
        """The policy's order (pods that just answered 429 last), and the predicted cached tokens."""
        pods = adapters.serving(pods, call.adapter)
        call.adapter_label = adapters.label(pods, call.adapter)
        groups = await self._key_groups(call, pods)
        ordered, reason = await self.decide(pods, call, groups)
        if call.scores_prompt and reason == "short_prompt":
            reason = "scores_prompt"
        if self.traffic.full_until:
            now = time.monotonic()
            ordered.sort(key=lambda c: self.traffic.full(c.name, now))
        self.metrics.decisions.labels(self.policy_name, reason).inc()
        # The engine serves at most len - 1 prompt tokens from its cache (the last one is always
        # computed, for logits): a prompt of whole blocks, all matched, has its last block recomputed.
        bs = self.block_size
        by_medium = predicted_by_medium(ordered[0], max(len(call.tokens) - 1, 0) // bs, bs)
        call.predicted, call.predicted_by_medium = sum(by_medium.values()), by_medium
        call.ordered, call.reason = ordered, reason

    async def decide(
        self, pods: list[Pod], call: Call, groups: list[tuple[list[Pod], list[int]]]
    ) -> tuple[list[Candidate], str]:
        """The routing policy's order of `pods` (best first) and its reason (router/policies);
        `groups`: the pods matched with each set of block keys."""
        inflight = self.traffic.inflight
        cands = [
            Candidate(
                p.name,
                p.url,
                p.kv_usage,
                max(p.load, inflight.get(p.name, 0)),
                affinity=adapters.affinity(p, call.adapter),
                costs=p.costs,
            )
            for p in pods
        ]
        # Ties break on the prompt's last full block: prompts that share only a system prompt
        # spread over the pods, and every router still picks the same pod for the same prompt.
        keys = call.keys
        tie = keys[-1].to_bytes(8, "little") if keys else call.body[:512]
        return await self.policy.order(
            RouteRequest(cands, keys, call.headers, tie, lambda: self._match(groups))
        )

    def _identity(self, call: Call, pods: list[Pod]) -> str:
        """The identity the request's keys chain from: on kvmesh engines an adapter's digest is the
        one most pods list (the others' keys are computed when it is routed)."""
        digest = adapters.usual_digest(pods, call.adapter) if call.adapter else ""
        return self.prompt_tokens.identity(call.req, digest)

    async def _key_groups(self, call: Call, pods: list[Pod]) -> list[tuple[list[Pod], list[int]]]:
        """The pods by the block keys they hold the prompt under: one group, but for an adapter
        that replicas list with different digests (each is matched with its own digest's keys)."""
        if call.adapter is None or self.prompt_tokens.vllm or not call.keys:
            return [(pods, call.keys)]
        by_identity: dict[str, list[Pod]] = {}
        for p in pods:
            ident = self.prompt_tokens.identity(call.req, p.adapters.get(call.adapter, ""))
            by_identity.setdefault(ident, []).append(p)
        groups = []
        for ident, members in sorted(by_identity.items()):
            keys = call.keys
            if ident != call.identity:
                keys = await off_loop(self.prompt_tokens.keys, call.tokens, call.req, ident)
            groups.append((members, keys))
        return groups

    async def _match(self, groups: list[tuple[list[Pod], list[int]]]) -> dict[str, Tiers] | None:
        """Matched leading blocks per pod and tier, one Redis round trip per group; None if Redis
        cannot say."""
        matched: dict[str, Tiers] = {}
        for pods, keys in groups:
            got = await self.prefix_match.match(pods, keys)
            if got is None:
                return None
            matched.update(got)
        return matched
