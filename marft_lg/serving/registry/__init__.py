"""Adapters on disk: versions and aliases, what a directory must be, LoRA settings."""
