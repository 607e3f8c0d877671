"""applianced: a single-binary, on-prem LLM inference appliance for one GPU box."""

__version__ = "0.1.0"
