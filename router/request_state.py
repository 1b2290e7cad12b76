"""One request's state on its way through the router's stages (each stage fills in its part)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmesh.router.auth import KeyInfo
from kvmesh.router.scoring import Candidate

if TYPE_CHECKING:
    from kvmesh.router.client_stream import ClientStream
    from kvmesh.router.flow.controller import Flow
    from kvmesh.router.hold_queue import Held


@dataclass
class Call:
    t0: float
    path: str
    route: str  # the metrics label
    headers: dict[str, str]  # names lower-cased
    rid: str  # X-Request-Id
    extra: list  # headers on every answer (X-Request-Id)
    client_id: str  # the rate-limit client: the API key's id, else "ip:<address>"
    query: bytes = b""  # the query string, passed on to the engine
    key_info: KeyInfo | None = None
    body: bytes = b""
    req: dict[str, Any] = field(default_factory=dict)
    generate: bool = False  # a completion or chat completion (else /tokenize, /detokenize, ...)
    chars: int = 0  # prompt size read cheaply (prompt_chars)
    charged: int = 0  # tokens charged to the rate limit so far
    scores_prompt: bool = False  # prompt logprobs: nothing comes from the cache
    tokens: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # contract-1 block keys of the prompt
    adapter: str | None = None  # the LoRA adapter it names (None: the served model)
    identity: str = ""  # the model identity `keys` chain from
    adapter_label: str = ""  # its adapter as the metrics label it (router/adapters.py)
    held: Held | None = None  # set while held for lack of a routable pod
    held_s: float | None = None
    ordered: list[Candidate] = field(default_factory=list)  # the pods to try, best first
    reason: str | None = None  # the routing decision's reason
    predicted: int = 0  # prompt tokens the chosen pod should serve from its cache (all tiers)
    predicted_by_medium: dict[str, int] = field(default_factory=dict)  # split by KV tier
    resumable: bool = False  # may go on with another replica if its engine fails (router/resume.py)
    stream: ClientStream | None = None  # a resumable stream's client side
    resumes: int = 0  # times it went on with another replica
    flow: Flow | None = None  # its tenant and band, with flow control on (router/flow)

    def holds(self) -> list[Held]:
        """The queues' holds it went through (scale from zero, flow control): each is told
        once its body is on an engine's socket, so the next held request may go."""
        flow_held = self.flow.held if self.flow is not None else None
        return [h for h in (self.held, flow_held) if h is not None]

    @property
    def tpm(self) -> float | None:
        return self.key_info.tpm if self.key_info else None
