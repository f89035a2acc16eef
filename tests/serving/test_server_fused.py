"""The HTTP server on a fused bundle (``mars-export --graph fused``): one KV slot, the Decoder's answers."""

from __future__ import annotations

import pytest
from server_support import serve
from support import export
from tiny_models import make_checkpoint

from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams
from runtime.serve import main
from runtime.text.tokenizer import Tokenizer


def test_a_fused_bundle_is_served_one_request_at_a_time(tmp_path, capsys):
    """One KV slot by default, answers equal to the Decoder's, and --max-batch-size 2 is one error
    line naming --graph step."""
    ckpt = make_checkpoint("llama", tmp_path / "ckpt")
    bundle = export(str(ckpt), tmp_path / "fused", 4, 4, "--mask-token", "<mask>", "--graph", "fused")
    config = load_config(bundle)
    ids = Tokenizer(bundle).encode("Hello there")
    expected = Decoder(OnnxBackend(bundle, config), config).generate(ids, DecodeParams(max_new_tokens=8)).token_ids
    with serve(str(bundle)) as server:
        assert server.app.state.ctx.engine_thread.engine.engine_config.max_batch_size == 1
        reply = server.client.completions.create(model="m", prompt="Hello there", max_tokens=8, temperature=0,
                                                 extra_body={"return_token_ids": True})
        assert reply.mars["token_ids"] == expected
    capsys.readouterr()
    assert main([str(bundle), "--max-batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: max_batch_size (--max-batch-size) 2 exceeds the backend's largest batch 1")
    assert "--graph step" in err


def test_ray_serve_refuses_more_slots_than_a_fused_bundle_runs_before_serve_starts(tmp_path, monkeypatch):
    from ray import serve

    from runtime.serving import ray_deploy

    ckpt = make_checkpoint("llama", tmp_path / "ckpt")
    bundle = export(str(ckpt), tmp_path / "fused", 4, 4, "--mask-token", "<mask>", "--graph", "fused")
    monkeypatch.setattr(serve, "start", lambda **kwargs: pytest.fail("Serve started"))
    # the option named as python -m runtime.serve names it (it said max_batch_size alone)
    with pytest.raises(ValueError, match=r"^max_batch_size \(--max-batch-size\) 2 exceeds the backend's largest "
                                         "batch 1 .*--graph step"):
        ray_deploy.deploy([str(bundle), "--max-batch-size", "2"], ray_deploy.FleetOptions())
