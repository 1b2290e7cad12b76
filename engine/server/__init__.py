"""The engine server: one engine replica behind an OpenAI-compatible HTTP API.

Modules: ``protocol`` (request/response models), ``async_engine`` (the engine thread
and its asyncio bridge), ``api`` (FastAPI routes), ``metrics`` (Prometheus),
``errors`` (OpenAI error bodies), ``cli`` (``kvmesh serve``).
"""
