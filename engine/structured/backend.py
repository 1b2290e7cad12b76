"""The engine's side of structured outputs: one grammar cache per model in a process (the API
side's check and the engine core share it when they share a process), the check that compiles a
spec before its request runs, and each request's grammar on its way to a matcher."""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path

from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.structured.compiler import GrammarCache, GrammarHandle, GrammarTimeout
from kvmesh.engine.structured.matcher import StructuredState
from kvmesh.engine.structured.params import StructuredOutputsParams

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 30.0  # a grammar still compiling after this fails its request (alone)

_backends: dict[tuple[str, int], StructuredBackend] = {}
_backends_lock = threading.Lock()


def backend_for(model_dir: str | Path, vocab_size: int) -> StructuredBackend:
    """The process's backend for this model's tokenizer and logits width."""
    key = (str(Path(model_dir).resolve()), vocab_size)
    with _backends_lock:
        backend = _backends.get(key)
        if backend is None:
            backend = _backends[key] = StructuredBackend(key[0], vocab_size)
        return backend


class StructuredBackend:
    def __init__(
        self, model_dir: str | Path, vocab_size: int, timeout_s: float = COMPILE_TIMEOUT_S
    ):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size  # the logits' width: the bitmask covers every column
        self.timeout_s = timeout_s
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()

    @property
    def cache(self) -> GrammarCache:
        """Built on first use (the tokenizer's vocabulary scan takes a few hundred milliseconds)."""
        with self._lock:
            if self._cache is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                tokenizer = PreTrainedTokenizerFast(
                    tokenizer_file=str(self.model_dir / "tokenizer.json")
                )
                with (
                    warnings.catch_warnings()
                ):  # "stop_token_ids ... detected": each matcher sets its own
                    warnings.simplefilter("ignore", UserWarning)
                    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._cache = GrammarCache(info, timeout_s=self.timeout_s)
                log.info("structured outputs: grammar cache ready (vocabulary %d)", self.vocab_size)
            return self._cache

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile the spec (or find it cached) and wait: a spec the backend refuses, or one still
        compiling at the deadline, is an InvalidParameter naming the request's field."""
        try:
            self.cache.compile_now(params)
        except GrammarTimeout as exc:
            raise InvalidParameter(params.param, str(exc)) from None

    def start(self, params: StructuredOutputsParams, stop_token_ids: set[int]) -> RequestGrammar:
        """A request's grammar, compiling off the step loop (the scheduler holds the request back
        until it is ready)."""
        return RequestGrammar(self.cache.submit(params), sorted(stop_token_ids))


class RequestGrammar:
    """One request's grammar: a handle while it compiles, then its matcher state. ``state``
    follows the request's output tokens (``Request.append_token`` advances it)."""

    def __init__(self, handle: GrammarHandle, stop_token_ids: list[int]):
        self.handle: GrammarHandle | None = handle
        self.stop_token_ids = stop_token_ids
        self.state: StructuredState | None = None
        self.refused = False  # a token the grammar did not allow was appended: nothing can follow

    @property
    def compiling(self) -> bool:
        return self.state is None

    def poll(self) -> bool:
        """Whether the grammar is ready (the matcher is built); raises the compile's failure
        (InvalidParameter, GrammarTimeout) once it is known. Never blocks."""
        if self.state is not None:
            return True
        if not self.handle.ready():
            return False
        compiled = self.handle.result()
        self.state = StructuredState(compiled, self.stop_token_ids or None)
        self.handle = None
        return True

    def accept(self, token_id: int) -> None:
        if self.state is not None and not self.refused and self.state.accept([token_id]) != 1:
            self.refused = True

    @property
    def done(self) -> bool:
        """The output is complete under the grammar (its stop token accepted), or cannot go on."""
        return self.refused or (self.state is not None and self.state.finished)

    def synced(self, request) -> StructuredState:
        """The matcher state, rebuilt from the request's outputs if it does not stand at their end
        (outputs it never saw: a resumed stream's)."""
        state = self.state
        if state.num_accepted != request.num_output_tokens and not self.refused:
            state.reset(request.output_token_ids)
        return state
