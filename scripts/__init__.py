"""Developer commands; `scripts.gpu` is the one-shot GPU check (docs/gpu-check.md)."""
