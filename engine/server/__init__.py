"""The engine server: one engine replica behind an OpenAI-compatible HTTP API.

Modules: ``protocol`` (request/response models), ``async_engine`` (the engine thread
and its asyncio bridge), ``api`` (the FastAPI app: routes only), ``serving_base`` (what every
request shares: admission, sampling parameters, SSE framing, errors), ``serving_completion`` and
``serving_chat`` (the two generation APIs), ``serving_tokenization`` (/tokenize, /detokenize),
``metrics`` (Prometheus), ``errors`` (OpenAI error bodies), ``cli`` (``kvmesh serve``);
tool calling: ``tool_choice`` (modes and schemas), ``tool_prompt`` (tools into the chat template),
``tool_parsers`` (calls read from the output, whole or streamed).
"""
