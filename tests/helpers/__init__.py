"""Test helpers (tiny models written as GGUF files, and the like)."""
