"""Model artifact build: pinned GGUF sources to a verified, deterministic model.tar.gz."""
