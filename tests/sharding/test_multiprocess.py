"""Two processes x 4 CPU devices through jax.distributed reproduce the HF goldens."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import FIXTURES

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): plain dp: the default run
# checks two processes with dp attention.
SLOW_CASES = ("test_two_processes_match_the_goldens[dp]",)

WORKER = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jaxdsa.distributed
    jaxdsa.distributed.initialize()  # coordinator, count and id from JAXDSA_* variables
    import numpy as np
    import jaxdsa
    fixture, tp, ep, dp, dp_attention = sys.argv[1], *map(int, sys.argv[2:6])
    golden = np.load(fixture + "/golden.npz")
    llm = jaxdsa.LLM(fixture, "float32", tp=tp, ep=ep, dp=dp, dp_attention=bool(dp_attention), page_size=8,
                     max_num_seqs=2 * dp, max_model_len=64, progress=False)
    assert llm.parallelism.num_devices == 8 and jax.process_count() == 2
    got = llm.score(golden["prompt_long"].tolist())
    want = golden["logits_long"]
    err = (np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)).max()
    tokens = llm.generate([golden["greedy_prompt"].tolist()], max_new_tokens=16)[0]
    same = tokens == golden["greedy_tokens"].tolist()
    print(f"process {jax.process_index()}: rel-L2 {err:.2e}, greedy equal {same}", flush=True)
    assert err <= 1e-4 and tokens == golden["greedy_tokens"].tolist()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (tp, ep, dp, dp_attention): one dp group per process; with dp attention the experts are split
# over both processes, so every MoE layer gathers and scatters tokens across them.
@pytest.mark.parametrize("layout", [(4, 2, 2, 0), (4, 4, 2, 1)], ids=["dp", "dp-attention"])
def test_two_processes_match_the_goldens(tmp_path, layout):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(
        os.environ,
        JAXDSA_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}",
        JAXDSA_NUM_PROCESSES="2",
        PYTHONPATH=os.getcwd(),
    )
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(FIXTURES / "glm52"), *map(str, layout)],
            env=dict(env, JAXDSA_PROCESS_ID=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
        assert "greedy equal True" in out
