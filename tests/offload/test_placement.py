"""Which experts stay on the device: the policies, the slot table, and clear errors."""

import json

import numpy as np
import pytest

from jaxdsa.offload.placement import ExpertPlacement, slot_table


def test_uniform_spreads_over_the_ids():
    p = ExpertPlacement(4)
    assert p.gpu_experts("any", 16) == (0, 4, 8, 12)
    assert p.host_experts("any", 16) == tuple(e for e in range(16) if e % 4)
    assert ExpertPlacement(20).gpu_experts("any", 16) == tuple(range(16))  # more than there are: all


def test_frequency_takes_the_most_routed_lower_id_on_ties():
    p = ExpertPlacement(2, "frequency", {"a": [1, 5, 5, 0]})
    assert p.gpu_experts("a", 4) == (1, 2)
    assert p.gpu_experts("b", 4) == (0, 2)  # no stats for this layer: uniform
    with pytest.raises(ValueError, match="3 counts for 4 experts"):
        ExpertPlacement(2, "frequency", {"a": [1, 2, 3]}).gpu_experts("a", 4)


def test_slot_table_puts_device_experts_first():
    table = slot_table((1, 3), (0, 2, 4))
    assert table.tolist() == [2, 0, 3, 1, 4]
    assert np.array_equal(np.sort(table), np.arange(5))


def test_arguments_are_checked(tmp_path):
    assert ExpertPlacement.of(None) is None
    with pytest.raises(ValueError, match="need num_gpu_experts"):
        ExpertPlacement.of(None, "frequency")
    with pytest.raises(ValueError, match="needs routing statistics"):
        ExpertPlacement.of(4, "frequency")
    with pytest.raises(ValueError, match="choose one of uniform, frequency"):
        ExpertPlacement.of(4, "popular")
    with pytest.raises(ValueError, match="must be 0 or more"):
        ExpertPlacement.of(-1)
    with pytest.raises(ValueError, match="cpu_threads 0"):
        ExpertPlacement.of(4, cpu_threads=0)
    bad = tmp_path / "stats.json"
    bad.write_text(json.dumps({"experts": {}}))
    with pytest.raises(ValueError, match=f"expert stats {bad}: not a routing statistics file"):
        ExpertPlacement.of(4, "frequency", bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"layers": {"m.experts": [3, 1]}}))
    assert ExpertPlacement.of(1, "frequency", good, cpu_threads=3).cpu_threads == 3
