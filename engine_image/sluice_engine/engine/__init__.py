"""The engine: its step (LLMEngine), the loop that drives it, the engine-core process and its messages,
the API side's client and output processor."""
