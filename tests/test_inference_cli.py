"""``shardwise generate`` (shardwise/train/generate_cli.py): a tiny run trained with
checkpoints generates the same greedy text as ``generate`` on ``load_model(RUN)`` in this
process, on one process and on 2 tensor-parallel ranks; a safetensors export without a
tokenizer takes ``--prompt-ids``; text is streamed without half characters; bad input
exits 2 with one line naming it before any rank starts."""

from __future__ import annotations

import io
import re

import pytest

from shardwise.checkpoint.export import export_safetensors
from shardwise.data import build_tokenizer
from shardwise.inference import Sampling, generate
from shardwise.inference.checkpoint import load_model, resolve_checkpoint
from shardwise.inference.session import TextStream
from shardwise.testing import run_ranks
from shardwise.testing.trainer import cli_args
from shardwise.train import launch
from shardwise.train.cli import main

TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4",
        "model.n_kv_heads": "2", "data.seq_len": "16", "train.batch_size": "2",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false",
        "train.steps": "2", "train.eval_interval": "0", "checkpoint.interval": "2",
        "parallel.nproc": "1"}
RATE = re.compile(r"^prompt tokens (\d+), new tokens (\d+), prefill [\d.]+ ms, decode "
                  r"[\d.]+ tokens/s$")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run of 2 steps with a checkpoint at the last, trained in this process."""
    root = tmp_path_factory.mktemp("generate")
    assert main(["train", *cli_args(TINY), "--log.dir", str(root / "run")]) == 0
    return root / "run"


def _want(run, prompt: str, n: int, **kw) -> str:
    tok = build_tokenizer("byte")
    model = load_model(run).model
    out = generate(model, [tok.encode(prompt).tolist()], max_new_tokens=n, **kw).tokens[0]
    return prompt + tok.decode(out)


def _printed(capfd, code: int) -> tuple[str, re.Match]:
    out, err = capfd.readouterr()
    assert code == 0, err
    text, rate = out.rstrip("\n").rsplit("\n", 1)
    m = RATE.match(rate)
    assert m, out
    return text, m


def test_generate_prints_the_greedy_text_and_the_rate(run, capfd):
    text, m = _printed(capfd, main(["generate", "--checkpoint", str(run), "--prompt", "def ",
                                    "--max-new-tokens", "8"]))
    assert text == _want(run, "def ", 8)
    assert m.groups() == ("4", "8")


def test_generate_on_two_tensor_parallel_ranks_prints_the_same(run, capfd):
    code = main(["generate", "--checkpoint", str(run), "--prompt", "def ",
                 "--max-new-tokens", "8", "--tp", "2"])
    text, m = _printed(capfd, code)
    assert text == _want(run, "def ", 8) and m.groups() == ("4", "8")


def test_a_batch_a_stop_token_and_sampling(run, capfd):
    tok = build_tokenizer("byte")
    model = load_model(run).model
    first = generate(model, [tok.encode("x = ").tolist()], max_new_tokens=6).tokens[0]
    code = main(["generate", "--checkpoint", str(run), "--prompt", "x = ", "--prompt", "if",
                 "--max-new-tokens", "6", "--stop", str(first[2])])
    text, m = _printed(capfd, code)
    upto = first.index(first[2]) + 1  # stopped after its first occurrence
    assert text.splitlines()[0] == "[0] x = " + tok.decode(first[:upto])
    assert text.splitlines()[1].startswith("[1] if")
    sampled = ["--temperature", "0.8", "--top-k", "50", "--seed", "3"]
    code = main(["generate", "--checkpoint", str(run), "--prompt", "def ",
                 "--max-new-tokens", "8", *sampled])
    text, _ = _printed(capfd, code)
    assert text == _want(run, "def ", 8, sampling=Sampling(temperature=0.8, top_k=50, seed=3))


def test_safetensors_without_a_tokenizer_take_prompt_ids(run, tmp_path, capfd):
    hf = tmp_path / "hf"
    export_safetensors(resolve_checkpoint(run), hf)
    code = main(["generate", "--checkpoint", str(hf), "--prompt-ids", "100,101,102,32",
                 "--max-new-tokens", "5"])
    text, m = _printed(capfd, code)
    ids = generate(load_model(hf).model, [[100, 101, 102, 32]], max_new_tokens=5).tokens[0]
    assert text == "".join(f" {i}" for i in [100, 101, 102, 32] + ids)
    code = main(["generate", "--checkpoint", str(hf), "--prompt", "def "])
    assert code == 2 and "--prompt-ids" in capfd.readouterr().err


def test_text_is_never_printed_half_a_character():
    tok = build_tokenizer("byte")
    sink = io.StringIO()
    stream = TextStream(tok, sink)
    seen = []
    for b in "a\u00e9\u20ac\U0001f600b".encode():
        stream.add(b)
        seen.append(sink.getvalue())
    assert all("\ufffd" not in s for s in seen)
    assert seen[1] == "a" and seen[2] == "a\u00e9" and seen[-2] == "a\u00e9\u20ac\U0001f600"
    stream.close()
    assert sink.getvalue() == "a\u00e9\u20ac\U0001f600b\n"
    broken = TextStream(tok, io.StringIO())
    for b in b"\xe2\x82":  # a character that never completes: shown as U+FFFD at the end
        broken.add(b)
    assert broken.out.getvalue() == ""
    broken.close()
    assert broken.out.getvalue() == "\ufffd\n"


def _refused(capfd, monkeypatch, *args: str) -> str:
    started = []
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: started.append(a))
    code = main(["generate", *args])
    out, err = capfd.readouterr()
    assert code == 2 and not started, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardwise: error: "), err
    return lines[0]


def test_bad_input_exits_2_before_any_rank(run, tmp_path, capfd, monkeypatch):
    line = _refused(capfd, monkeypatch, "--checkpoint", str(tmp_path / "nope"), "--prompt", "a")
    assert "does not exist" in line
    empty = tmp_path / "untrained"  # what `shardwise train` leaves by default: no checkpoint
    empty.mkdir()
    (empty / "config.toml").write_text((run / "config.toml").read_text())
    line = _refused(capfd, monkeypatch, "--checkpoint", str(empty), "--prompt", "a", "--tp", "2")
    assert "--checkpoint.interval" in line
    line = _refused(capfd, monkeypatch, "--checkpoint", str(run), "--prompt", "a", "--tp", "3")
    assert "n_heads=4 is not divisible by tp=3" in line
    line = _refused(capfd, monkeypatch, "--checkpoint", str(run), "--prompt", "def ",
                    "--max-new-tokens", "1000", "--tp", "2")
    assert "--max-new-tokens 1000 is too large" in line and "max_seq_len=256" in line
    line = _refused(capfd, monkeypatch, "--checkpoint", str(run), "--prompt", "a",
                    "--stop", "ab")
    assert "--stop 'ab' is 2 tokens" in line


def test_streamed_and_low_bit_weights(run, capfd, monkeypatch):
    """--stream-weights gives the loaded model's greedy text; --weights int8 / int4 stream a
    store written from the checkpoint (its text may differ: the weights are rounded)."""
    code = main(["generate", "--checkpoint", str(run), "--prompt", "def ",
                 "--max-new-tokens", "8", "--stream-weights", "--device", "cpu"])
    text, m = _printed(capfd, code)
    assert text == _want(run, "def ", 8) and m.groups() == ("4", "8")
    for kind in ("int8", "int4"):
        code = main(["generate", "--checkpoint", str(run), "--prompt", "def ",
                     "--max-new-tokens", "8", "--weights", kind, "--device", "cpu"])
        text, m = _printed(capfd, code)
        assert text.startswith("def ") and m.groups() == ("4", "8")
    line = _refused(capfd, monkeypatch, "--checkpoint", str(run), "--prompt", "a",
                    "--stream-weights", "--tp", "2")
    assert "--stream-weights runs on one process" in line


def _cli_rank(argv: list[str]) -> tuple[int, str]:
    """One rank of a torchrun-style job (RANK / WORLD_SIZE set) running the command."""
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def test_under_torchrun_every_rank_is_a_tensor_rank_and_rank_0_prints(run):
    argv = ["generate", "--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "8"]
    (c0, out0), (c1, out1) = run_ranks(_cli_rank, 2, args=(argv,), timeout_s=120)
    assert (c0, c1) == (0, 0) and out1 == ""
    text, rate = out0.rstrip("\n").rsplit("\n", 1)
    assert text == _want(run, "def ", 8) and RATE.match(rate)
    (c0, _), (c1, _) = run_ranks(_cli_rank, 2, args=(argv + ["--tp", "3"],), timeout_s=60)
    assert (c0, c1) == (2, 2)  # refused on every rank before any collective


def test_a_bpe_run_saves_its_tokenizer_and_generate_reads_it(tmp_path, capfd, monkeypatch):
    """The trainer writes ``tokenizer.json`` beside config.toml; ``generate`` encodes with
    it (training BPE again is not called) and gets the trained tokenizer's ids."""
    pytest.importorskip("tokenizers")
    from shardwise.data import load_corpus, load_tokenizer
    import shardwise.data as data

    bpe = {**TINY, "data.tokenizer": "bpe", "data.bpe_vocab_size": "300"}
    assert main(["train", *cli_args(bpe), "--log.dir", str(tmp_path / "run")]) == 0
    capfd.readouterr()
    saved = load_tokenizer(tmp_path / "run" / "tokenizer.json")
    trained = build_tokenizer("bpe", vocab_size=300, text=load_corpus("stdlib",
                                                                      max_bytes=200000))
    sample = "def shard(x):\n    return x"
    assert saved.encode(sample).tolist() == trained.encode(sample).tolist()

    def no_training(*args, **kwargs):
        raise AssertionError("generate trained the tokenizer again")

    monkeypatch.setattr(data, "build_tokenizer", no_training)
    text, m = _printed(capfd, main(["generate", "--checkpoint", str(tmp_path / "run"),
                                    "--prompt", "def ", "--max-new-tokens", "4"]))
    assert text.startswith("def ") and m.groups()[0] == str(len(saved.encode("def ")))
