"""Engines: the interface, the embedded HF engine (continuous batching, LoRA per row), vLLM."""
