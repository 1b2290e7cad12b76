"""Speculative decoding: n-gram prompt lookup drafts, verified in the target model's own step.

* ``config.SpeculativeConfig``: the ``speculative_config`` engine argument, validated;
* ``ngram.NgramProposer``: drafts from the request's own tokens, vectorised over the batch;
* ``rejection.verify``: greedy prefix match or rejection sampling over the drafts' logits;
* ``controller.SpecDecoder``: when to draft (batch size, per-request acceptance) and the counters.

See docs/engine.md, "Speculative decoding".
"""

from kvmesh.engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
