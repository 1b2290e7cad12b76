"""The engine server: one engine replica behind an OpenAI-compatible HTTP API.

Modules: ``protocol`` (request/response models), ``async_engine`` (the engine thread and its asyncio
bridge), ``api`` (the FastAPI app: routes only), ``server_state`` (config, state, auth and
readiness), ``request_body`` (a body read and validated), ``choices`` (one engine request per prompt
and sample, fitted to the context), ``streaming`` and ``responses`` (outputs as SSE chunks or a
whole response), ``serving_base`` (a generation request's life: admission, then its outputs),
``serving_completion`` and ``serving_chat`` (the two generation APIs), ``serving_tokenization``
(/tokenize, /detokenize), ``off_loop`` (a large request's CPU work off the event loop), ``metrics``
(Prometheus), ``errors`` (OpenAI error bodies), ``cli`` (``kvmesh serve``); tool calling:
``tool_choice`` (modes and schemas), ``tool_prompt`` (tools into the chat template),
``tool_parsers`` (calls read from the output, whole or streamed).
"""
