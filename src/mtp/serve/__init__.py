"""`mtp serve`: an OpenAI-compatible HTTP server with MTP speculative decoding (needs the `serve` extra)."""
