"""KV-cache handoff between prefill and decode workers (CUDA IPC / shared memory)."""
