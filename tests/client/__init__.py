"""Tests of the `client` package."""
