"""Tests of the `images` package."""
