"""vLLM (its CPU build) as an engine specaudit can start: a venv of its own in the cache
(`env`), a managed OpenAI-compatible server (`server`), a tiny model to start it on (`tiny`)."""
