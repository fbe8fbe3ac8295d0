"""Helpers the tests import (fixtures stay in conftest.py, which nothing imports)."""
