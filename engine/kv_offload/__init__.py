"""KV tiers beyond the engine's KV cache: the host tier and the shared tier."""
