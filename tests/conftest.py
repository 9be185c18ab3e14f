"""Shared test setup: JAX on the CPU, fixture locations."""

import os
import pathlib
import re

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Warmed steps are not loaded from an earlier run's executable store unless a test asks for it
# (tests/engine/test_executables.py): a test that counts lowerings must see them.
os.environ.setdefault("JAXDSA_EXECUTABLE_CACHE", "0")
# Most of the suite's time is XLA:CPU compiling tiny models' steps, and XLA's LLVM level 1 compiles them
# about 15 % faster than level 3 with the same outputs (level 0 is 30 % faster but moves last bits:
# benchmarks/results/cpu_compile_levels-cpu.md). Set before JAX starts its backend, and inherited by
# the servers the tests start.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=1".strip()

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark slow the cases a module names in ``SLOW_CASES`` (test names with their parameter ids, ``*``
    matching anything): variants of a path the default run checks in another case of that module,
    left to ``pytest -m slow`` so that the default run fits a 2-core CI machine with a cold cache."""
    for item in items:
        patterns = getattr(getattr(item, "module", None), "SLOW_CASES", ())
        if any(re.fullmatch(re.escape(p).replace(r"\*", ".*"), item.name) for p in patterns):
            item.add_marker(pytest.mark.slow)
