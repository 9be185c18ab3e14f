"""Shared test setup: JAX on the CPU, fixture locations."""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
