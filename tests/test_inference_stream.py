"""Weights streamed from disk (shardwise/inference/weights): bitwise logits from DCP (one
process and ZeRO-3 chunks of 3 ranks) and safetensors (Hugging Face and our names), dense,
MoE and tied; the int8 / int4 store; bounded RSS for a model 4x the cap; the read thread
on errors and close; a missing tensor named before the first forward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardwise
from shardwise import checkpoint
from shardwise.checkpoint.export import export_safetensors, write_safetensors
from shardwise.inference.weights import (measure_read_bandwidth, quantize_checkpoint,
                                         stream_weights)
from shardwise.inference.weights.store import unit_of
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.quant.codecs import dequantize, error_bound, quantize
from shardwise.testing import run_ranks

CONFIGS = {"dense": ("debug", {}), "moe": ("debug-moe", {}),
           "tied": ("debug", {"tie_embeddings": True})}


def _config(which: str):
    name, over = CONFIGS[which]
    return get_model_config(name, **over)


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per config: the resident model and its checkpoint as DCP, HF safetensors and
    shardwise-named safetensors."""
    root, out = tmp_path_factory.mktemp("stream"), {}
    for which in CONFIGS:
        model = build_model(_config(which), seed=0).eval()
        d = root / which
        checkpoint.save(d / "dcp", model, step=1)
        export_safetensors(d / "dcp", d / "hf")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  str(d / "ours.safetensors"))
        out[which] = (model, d)
    return out


def _streamed(cfg, src, tokens, **kw):
    meta = build_model(cfg, device="meta").eval()
    with stream_weights(meta, src, **kw) as stream, torch.no_grad():
        first, second = meta(tokens), meta(tokens)
        stats = stream.stats()
    assert all(p.is_meta for p in meta.parameters())  # close puts everything back
    return first, second, stats


GRID = [("dense", "dcp", 1), ("dense", "hf", 1), ("dense", "ours.safetensors", 1),
        ("dense", "dcp", 0), ("dense", "hf", 2), ("moe", "dcp", 1), ("moe", "hf", 2),
        ("tied", "dcp", 1), ("tied", "hf", 0)]


@pytest.mark.parametrize("which,src,prefetch", GRID)
def test_streamed_logits_are_bitwise_the_resident_models(saved, which, src, prefetch):
    model, d = saved[which]
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        want = model(tokens)
    first, second, stats = _streamed(model.config, d / src, tokens, prefetch=prefetch)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert stats["forwards"] == 2 and stats["units_loaded"] == 2 * (model.config.n_layers + 1)
    assert stats["misses"] == (0 if prefetch else 2 * model.config.n_layers)


@pytest.mark.parametrize("src", ["dcp", "hf"])
def test_bf16_compute_from_fp32_files_is_the_cast_model(saved, src):
    model, d = saved["dense"]
    tokens = _tokens(model.config.vocab_size)
    want_model = build_model(model.config, seed=0).eval().to(torch.bfloat16)
    with torch.no_grad():
        want = want_model(tokens)
    meta = build_model(model.config, device="meta").eval().to(torch.bfloat16)
    with stream_weights(meta, d / src) as stream, torch.no_grad():
        got = meta(tokens)
        assert stream.stats()["work_buffer_bytes"] < 0.6 * stream.bytes_per_forward()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def _save_sharded(root: str) -> None:
    for which in ("dense", "moe"):
        model = shardwise.shard(build_model(_config(which), seed=0), stage=3,
                                wrap={TransformerBlock})
        checkpoint.save(f"{root}/{which}", model, step=1)


def test_dcp_chunks_of_three_ranks_are_assembled(saved, tmp_path):
    run_ranks(_save_sharded, 3, args=(str(tmp_path),))  # ZeRO-3: rows cut 3 ways, unevenly
    for which in ("dense", "moe"):
        model, _ = saved[which]
        tokens = _tokens(model.config.vocab_size)
        with torch.no_grad():
            want = model(tokens)
        first, _, _ = _streamed(model.config, tmp_path / which, tokens)
        assert torch.equal(first, want), which


def _codec_model(model, kind: str):
    """The resident model with exactly the weights the store holds: every weight of a unit of
    2+ dims but the routers' through the codec; each within codecs.error_bound."""
    q = build_model(model.config, seed=0).eval()
    with torch.no_grad():
        for name, p in q.named_parameters():
            if p.dim() >= 2 and unit_of(name) != "embedding" and ".router." not in name \
                    and unit_of(name) != "resident":
                d = dequantize(quantize(p, kind))
                # expert 0 of a stacked tensor stands for the rest (blocks run along rows)
                x, y = (p, d) if p.dim() == 2 else (p[0], d[0])
                assert bool(((y - x).abs().double() <= error_bound(x, kind)).all()), name
                p.copy_(d)
    return q


@pytest.mark.parametrize("which,kind,shrink", [("dense", "int8", 3.9), ("dense", "int4", 7.5),
                                               ("moe", "int4", 7.5)])
def test_quantised_store_is_the_codec_model_and_reads_fewer_bytes(saved, tmp_path, which,
                                                                   kind, shrink):
    # Asserted bound: the streamed logits are bitwise those of the resident model whose
    # weights are dequantize(quantize(w)), each weight within error_bound(w) of the
    # original (half a codec step: absmax / 254 for int8, absmax / 14 for int4 per block).
    model, d = saved[which]
    store = quantize_checkpoint(d / "dcp", tmp_path / kind, kind=kind)
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        want = _codec_model(model, kind)(tokens)
        fp32 = model(tokens)
    first, _, stats = _streamed(model.config, store, tokens)
    _, _, full = _streamed(model.config, d / "dcp", tokens)
    assert torch.equal(first, want)
    rel = ((first - fp32).norm() / fp32.norm()).item()
    assert rel < (0.05 if kind == "int8" else 0.5), rel  # a sanity check, not the bound
    assert full["bytes_per_forward"] / stats["bytes_per_forward"] > shrink


def test_embedding_reads_only_the_batch_rows(saved):
    model, d = saved["dense"]
    tokens = torch.tensor([[3, 5, 3, 7], [7, 7, 9, 3]])  # 4 distinct ids
    meta = build_model(model.config, device="meta").eval()
    stream = stream_weights(meta, d / "dcp")
    stream.reset_stats()
    with torch.no_grad():
        got = meta(tokens)
    stream.close()  # drains the read of layer 0 the head started for the next forward
    layer0 = stream.units[0].nbytes_read
    row = model.config.dim * 4
    assert stream.stats()["bytes_read"] == stream.bytes_per_forward() + layer0 + 4 * row
    with torch.no_grad():
        assert torch.equal(got, model(tokens))


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shardwise-weights")]


def test_an_error_in_the_forward_leaves_no_read_behind_and_close_joins(saved):
    model, d = saved["dense"]
    tokens = _tokens(model.config.vocab_size)
    meta = build_model(model.config, device="meta").eval()
    stream = stream_weights(meta, d / "hf", prefetch=2)

    def boom(module, args):
        raise RuntimeError("boom in layer 1")

    handle = meta.layers[1].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom in layer 1"), torch.no_grad():
        meta(tokens)
    assert all(b.unit is None and b.future is None for b in stream._buffers)
    assert all(p.is_meta for n, p in meta.named_parameters() if p.dim() >= 2)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(meta(tokens), model(tokens))  # still usable
    assert _stream_threads()
    stream.close()
    assert not _stream_threads()
    stream.close()  # idempotent; the hooks are gone and the weights on meta again
    assert meta(tokens).is_meta


def test_a_missing_or_misshapen_tensor_is_named_before_any_forward(saved, tmp_path):
    model, _ = saved["dense"]
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    missing = dict(sd)
    del missing["layers.1.attention.wk.weight"]
    save_file(missing, str(tmp_path / "missing.safetensors"))
    meta = build_model(model.config, device="meta")
    with pytest.raises(ValueError, match=r"layers\.1\.attention\.wk\.weight"):
        stream_weights(meta, tmp_path / "missing.safetensors")
    w2 = "layers.0.feed_forward.w2.weight"
    sd[w2] = sd[w2][:, :8].contiguous()
    save_file(sd, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.0\.feed_forward\.w2\.weight.*shape"):
        stream_weights(meta, tmp_path / "shape.safetensors")
    with pytest.raises(ValueError, match="meta device"):
        stream_weights(model, tmp_path / "missing.safetensors")
    assert not _stream_threads()


_CHILD = r"""
import json, sys
import torch
from shardwise.inference.weights import stream_weights
from shardwise.models import LlamaConfig, build_model

def status(key):  # VmRSS now, VmHWM the peak, in bytes
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

torch.set_num_threads(1)
cfg = LlamaConfig(**json.loads(sys.argv[2]))
base = status("VmRSS")
model = build_model(cfg, device="meta").eval()
with stream_weights(model, sys.argv[1], drop_page_cache=True) as stream, torch.no_grad():
    for _ in range(2):
        model(torch.arange(8).view(1, 8))
    predicted = stream.resident_bytes(num_tokens=8)
    read = stream.stats()["bytes_read"]
# VmHWM, not getrusage's ru_maxrss: exec keeps the forking parent's peak in ru_maxrss
# (the pytest process, hundreds of MB), VmHWM is this process's own
peak = status("VmHWM")
print(json.dumps({"growth": peak - base, "predicted": predicted, "read": read}))
"""


def test_a_model_four_times_the_rss_cap_streams_under_it(tmp_path):
    cap = 50 * 2**20
    shape = dict(dim=512, n_layers=16, n_heads=8, n_kv_heads=8, vocab_size=1024,
                 multiple_of=256, max_seq_len=64)
    cfg = get_model_config("debug", **shape)
    meta = build_model(cfg, device="meta")
    entries = [(n, t.dtype, tuple(t.shape)) for n, t in meta.state_dict().items()]
    gen = torch.Generator().manual_seed(0)

    def produce(name):
        t = dict(meta.state_dict())[name]
        return torch.ones(t.shape) if t.dim() == 1 else torch.randn(t.shape, generator=gen) * 0.02

    path = tmp_path / "big.safetensors"
    size = write_safetensors(path, entries, produce)
    assert size > 4 * cap
    env = {**os.environ, "PYTHONPATH": str(Path(shardwise.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), json.dumps(shape)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["read"] >= 2 * 0.95 * size  # the weights were read, twice
    assert got["growth"] < cap, got
    # the prediction is the buffers' bytes; the rest is activations and allocator slack
    assert 0.9 * got["predicted"] <= got["growth"] <= got["predicted"] + 16 * 2**20, got


def test_read_bandwidth_is_measured_on_the_files(saved):
    _, d = saved["dense"]
    files = sorted(str(p) for p in (d / "dcp").glob("*.distcp"))
    bw = measure_read_bandwidth(files)
    assert bw > 1e6
    with pytest.raises(ValueError, match="no file"):
        measure_read_bandwidth([])
