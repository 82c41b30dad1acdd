"""HTTP layer: an OpenAI-compatible API over the engine (server -> engine, never the reverse)."""
