"""Tests of the `adapter` package."""
