"""vLLM's ``--enable-expert-parallel`` on a mesh of CPU devices: the experts over every GPU of the
tp x dp groups (ep = tp x dp), attention data-parallel between the groups."""

from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.serve import cli


def test_enable_expert_parallel_splits_the_experts_over_tp_times_dp(tmp_path, capsys):
    path = make_tiny("glm_moe_dsa", str(tmp_path), seed=0)
    argv = [path, "--host", "127.0.0.1", "--port", "0", "--no-warmup", "--enable-expert-parallel"]
    server = cli.build(cli.parse_args([*argv, "--tensor-parallel-size", "4", "--data-parallel-size", "2"]))
    try:
        assert "tp 4 ep 8 dp 2 with dp attention" in capsys.readouterr().err
        mesh = server.engine.engine.runner.mesh
        assert mesh.size == 8 and server.engine.engine.runner.groups == 2  # two dp groups over 8 devices
    finally:
        server.engine.shutdown()
