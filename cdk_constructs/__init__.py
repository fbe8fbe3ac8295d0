"""Typed CDK constructs for the decision-model app; every prop is keyword-only and explicit.

Each construct's prop types (frozen dataclasses, validated in `__post_init__`) live in its
own module; nothing here imports `stacks` or reads context or environment variables.
Named `cdk_constructs` because a top-level `constructs` package would shadow the library.
"""
