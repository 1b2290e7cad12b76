"""Grammars compiled on a thread pool, off the step loop, and kept in a bounded LRU keyed by
(kind, spec). The step loop never waits: it polls `GrammarHandle.ready()`, and a compile that
outlives its deadline fails its own request only (the thread finishes in the background; xgrammar
cannot be interrupted)."""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from threading import Lock

import xgrammar as xgr

from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.structured.params import StructuredOutputsParams


class GrammarTimeout(RuntimeError):
    """A grammar took longer than the compile deadline."""


def compile_spec(
    compiler: xgr.GrammarCompiler, params: StructuredOutputsParams
) -> xgr.CompiledGrammar:
    """The compiled grammar of one spec; a spec xgrammar refuses (a bad regex, EBNF or an unsupported
    schema feature) raises InvalidParameter naming the request field."""
    kind, spec = params.key
    try:
        # Compact JSON (no free whitespace between tokens): with whitespace allowed, a weak or
        # random-weight model can emit whitespace forever and never close the document.
        if kind == "json":
            return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            # Each choice a quoted EBNF literal: JSON string escaping is what GBNF literals take, with
            # non-ASCII characters as they are (a \ud83d\ude00 surrogate pair is not one GBNF character).
            return compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            )
        return compiler.compile_grammar(spec)
    except Exception as exc:  # noqa: BLE001 - whatever the backend raises, the client's spec is at fault
        text = str(exc).strip()
        # xgrammar prefixes "[hh:mm:ss] file.cc:line: " to its messages: the client needs the rest.
        reason = (
            re.sub(r"^\[[^\]]*\]\s+\S+:\d+:\s*", "", text.splitlines()[0])
            if text
            else type(exc).__name__
        )
        raise InvalidParameter(
            params.param, f"{params.param} cannot be compiled: {reason}"
        ) from None


@dataclass
class GrammarHandle:
    """A grammar on its way: the step loop polls ready() and never blocks on it."""

    future: Future
    deadline: float

    def ready(self) -> bool:
        """True once compiled or failed (result() then returns or raises at once)."""
        return self.future.done() or time.monotonic() >= self.deadline

    def result(self) -> xgr.CompiledGrammar:
        if not self.future.done():
            raise GrammarTimeout("grammar compilation exceeded its deadline")
        return self.future.result()


class GrammarCache:
    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        max_entries: int = 256,
        max_threads: int = 2,
        timeout_s: float = 30.0,
    ):
        self.tokenizer_info = tokenizer_info
        # xgrammar's own cache is off: ours is bounded by entries and shared with the futures.
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="grammar")
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = Lock()
        self.max_entries = max_entries
        self.timeout_s = timeout_s

    def submit(self, params: StructuredOutputsParams) -> GrammarHandle:
        key = params.key
        with self._lock:
            future = self._entries.get(key)
            new = future is None
            if new:
                future = self._pool.submit(compile_spec, self._compiler, params)
                self._entries[key] = future
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
        if new:
            # A failed compile is not cached: the next request with that spec tries again. Added
            # outside the lock: on a future already done the callback runs here, and takes the lock.
            future.add_done_callback(
                lambda f, k=key: f.exception() is not None and self._drop(k, f)
            )
        return GrammarHandle(future, time.monotonic() + self.timeout_s)

    def _drop(self, key, future) -> None:
        with self._lock:
            if self._entries.get(key) is future:
                del self._entries[key]

    def compile_now(
        self, params: StructuredOutputsParams, timeout_s: float | None = None
    ) -> xgr.CompiledGrammar:
        """Compile (or find) the grammar and wait for it: the server's check before a request runs,
        so a bad spec is a 400 rather than a failed stream."""
        handle = self.submit(params)
        try:
            return handle.future.result(timeout=self.timeout_s if timeout_s is None else timeout_s)
        except TimeoutError:
            raise GrammarTimeout(
                f"{params.param}: grammar compilation exceeded "
                f"{self.timeout_s if timeout_s is None else timeout_s:g} s"
            ) from None

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
