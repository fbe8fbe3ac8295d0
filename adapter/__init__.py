"""SemIf-style decision adapter: probabilities over declared options from llama.cpp logits.

Importing this package is cheap: llama.cpp is only loaded by `adapter.core`.
"""
