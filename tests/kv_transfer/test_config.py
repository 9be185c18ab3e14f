"""``--kv-transfer-config``: vLLM's JSON as deployment guides write it is taken, and what jaxdsa cannot
do (or does not know) is refused naming the key."""

from __future__ import annotations

import json

import pytest

from jaxdsa.kv_transfer.config import KVTransferConfig


def test_the_guides_configs_are_taken():
    mooncake = KVTransferConfig.parse(
        json.dumps({"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": "20001",
                    "engine_id": "p-0", "kv_connector_extra_config": {"lease_s": 30}})
    )  # fmt: skip
    assert (mooncake.kv_role, mooncake.engine_id, mooncake.lease_s) == ("kv_producer", "p-0", 30.0)
    assert mooncake.produces and not mooncake.consumes
    both = KVTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert both.produces and both.consumes and len(both.engine_id) == 32  # a fresh id when none given
    assert both.transfer_timeout_s == 30.0


@pytest.mark.parametrize(
    "text, says",
    [
        ("[1]", "must be a JSON object"),
        ("{", "not JSON"),
        ('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}', "kv_connector 'LMCacheConnectorV1'"),
        ('{"kv_connector": "NixlConnector", "kv_role": "kv_decoder"}', "kv_role 'kv_decoder'"),
        ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}',
         "only 'fail'"),
        ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_module_path": "x.y"}',
         "not loaded"),
        ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_bufer_size": 1}', "kv_bufer_size"),
        ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"lease": 1}}',
         "unknown key(s) lease"),
        ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
         '"kv_connector_extra_config": {"transfer_timeout_s": 0}}', "transfer_timeout_s must be a number"),
    ],
)  # fmt: skip
def test_what_cannot_be_done_is_refused_by_name(text, says):
    with pytest.raises(ValueError) as error:
        KVTransferConfig.parse(text)
    assert says in str(error.value)
