"""The KV-event sidecar: the index writer (an engine's KV-cache events -> Redis). The router is the reader."""
