"""How users reach the engine: the `sluice` command line, the offline LLM, the OpenAI server."""
