"""mgtrace: record vLLM hybrid-model align-mode bookkeeping, replay it offline, find the first
corrupt step."""

__version__ = "0.1.0"
