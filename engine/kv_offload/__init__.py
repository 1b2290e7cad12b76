"""KV tiers beyond the KV cache: the host tier, the shared tier's plug, transfers and costs."""
