"""bench/inference_bench.py: one tiny run of every peer (shardwise, transformers with a static
and a dynamic cache) on an imported Llama, rendered as the results tables, so the benchmark
cannot silently rot."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench.inference_bench import parse_args, run, to_markdown, verdict  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_verdict_needs_every_round():
    assert verdict([1.0, 1.3]) == "met in every round"
    assert verdict([0.8, 0.9]) == "not met"
    assert verdict([0.9, 1.1]).startswith("not settled")


def test_a_tiny_run_gives_the_same_tokens_and_a_table():
    args = parse_args(["--sizes", "tiny", "--batches", "1,2", "--rounds", "1",
                       "--prompt-len", "5", "--new", "4", "--threads", "1"])
    record = run(args)
    rows = record["sizes"]["tiny"]["batches"]
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert row["same_tokens"] == {"hf_static": True, "hf_dynamic": True}
        assert all(len(row["per_round"][p]["tok_s"]) == 1 for p in row["per_round"])
    md = to_markdown(record)
    assert md.count("| tiny |") == 12 and "decode tokens / CPU second" in md


def test_an_unknown_size_is_named():
    with pytest.raises(SystemExit):
        parse_args(["--sizes", "10m,huge"])
