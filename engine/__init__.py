"""The kvmesh inference engine: paged KV cache, token-budget scheduler, prefix caching.

from kvmesh.engine import LLM, SamplingParams
llm = LLM("smollm2-135m-instruct")
print(llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))[0].text)
"""

from kvmesh.engine.config import EngineArgs
from kvmesh.engine.outputs import CompletionOutput, RequestOutput
from kvmesh.engine.sampling_params import InvalidParameter, SamplingParams


def __getattr__(name):  # torch-heavy parts load on first use
    if name == "LLM":
        from kvmesh.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvmesh.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineCore":
        from kvmesh.engine.engine_core import EngineCore

        return EngineCore
    raise AttributeError(name)


__all__ = [
    "LLM",
    "LLMEngine",
    "EngineCore",
    "EngineArgs",
    "SamplingParams",
    "InvalidParameter",
    "RequestOutput",
    "CompletionOutput",
]
