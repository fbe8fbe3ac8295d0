"""Tests of the GPU check's CPU-side parts: preparation, model generator, checks, sizes."""
