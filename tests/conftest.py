"""Shared test setup: JAX on the CPU, fixture locations."""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Warmed steps are not loaded from an earlier run's executable store unless a test asks for it
# (tests/engine/test_executables.py): a test that counts lowerings must see them.
os.environ.setdefault("JAXDSA_EXECUTABLE_CACHE", "0")

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
