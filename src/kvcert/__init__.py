"""kvcert: randomized KV-cache eviction with Hajek correction and per-step error certificates."""
