"""Tests of the `model_build` package."""
