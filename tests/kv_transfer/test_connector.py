"""The connector alone (two in one process, real NIXL agents): an offered image is read byte for
byte and released on the reader's notification; one nobody reads is released when its lease runs
out; params that describe no image, or whose lease has run out, are refused before any read."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxdsa.engine.handoff import CacheImage, EntryImage, ImageLayout
from jaxdsa.kv_transfer import TransferError
from jaxdsa.kv_transfer.config import KVTransferConfig
from jaxdsa.kv_transfer.connector import KVConnector


def connector(role: str, **extra) -> KVConnector:
    config = KVTransferConfig.parse(f'{{"kv_connector": "NixlConnector", "kv_role": "{role}"}}')
    return KVConnector(config.__class__(**{**config.__dict__, **extra}))


def image(seed: int) -> CacheImage:
    layout = ImageLayout(5, 4, (EntryImage(0, "latent", (2, 2, 4, 8), "float32"),))
    data = np.random.default_rng(seed).integers(0, 255, layout.nbytes, dtype=np.uint8)
    return CacheImage(layout, 7, data)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_offered_image_is_read_then_released():
    prefill, decode = connector("kv_producer"), connector("kv_consumer")
    try:
        sent = image(0)
        source = decode.source(prefill.offer(sent))
        assert (source.first_token, source.layout) == (7, sent.layout)
        source.start()
        arrived = []
        wait_for(lambda: arrived.append(source.poll()) or arrived[-1] is not None, "the read")
        np.testing.assert_array_equal(arrived[-1].data, sent.data)
        wait_for(lambda: not prefill._offers, "the prefill side to release the image")
        assert decode.stats.received == 1 and decode.stats.received_bytes == sent.data.nbytes
    finally:
        prefill.close()
        decode.close()


def test_unread_offer_expires_and_late_or_bad_params_are_refused():
    prefill, decode = connector("kv_producer", lease_s=0.2), connector("kv_consumer")
    try:
        params = prefill.offer(image(1))
        wait_for(lambda: prefill.stats.expired == 1, "the lease to run out")
        with pytest.raises(TransferError, match="lease"):
            decode.source(params)
        with pytest.raises(ValueError, match="do not describe"):
            decode.source({k: v for k, v in params.items() if k != "remote_region"})
        with pytest.raises(ValueError, match="byte"):
            decode.source(
                params
                | {
                    "lease_expires": time.time() + 60,
                    "remote_region": params["remote_region"] | {"nbytes": 8},
                }
            )
    finally:
        prefill.close()
        decode.close()
