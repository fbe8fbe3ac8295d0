"""Typed CDK constructs for the decision-model app; every prop is keyword-only and explicit.

Named `cdk_constructs` because a top-level `constructs` package would shadow the library.
"""
