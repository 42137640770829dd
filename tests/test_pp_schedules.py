"""Pipeline schedules as data: actions, generators, CSV / text forms, validator, refusals, CLI.

Pure Python (no ranks). The simulator and the published bubble formulas are in
test_pp_simulate.py.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from shardwise.parallel import (SCHEDULE_NAMES, Action, Costs, DeadlockError, Kind, Schedule,
                                build_schedule, simulate, validate_schedule)
from shardwise.parallel.pipeline.messages import add_communication, steps
from shardwise.parallel.pipeline.action_lists import add_engine_actions, gather_rounds


def grid():
    """(name, pp, microbatches, virtual) points every generator must handle."""
    for name, p, m in itertools.product(SCHEDULE_NAMES, (1, 2, 3, 4, 5), (1, 2, 3, 5, 8, 11)):
        virtuals = {"interleaved_1f1b": (2, 3, 4), "looped_bfs": (1, 2, 3)}.get(name, (0,))
        for v in virtuals:
            if name == "dualpipev" and m < 2 * p:
                continue
            yield name, p, m, v


GRID = list(grid())


def _expected_virtual(name: str, v: int) -> int:
    return v or {"gpipe": 1, "1f1b": 1, "zb1": 1}.get(name, 2)


# ---- actions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(Kind))
def test_action_text_round_trip(kind):
    a = Action(12, kind, 305)
    assert str(a) == f"12{kind.value}305"
    assert Action.parse(f" {a} ") == a
    assert [a.is_compute, a.is_comm, a.is_engine].count(True) == 1


@pytest.mark.parametrize("text", ["F3", "0X3", "0F", "0SEND3", "0 F 3", "-1F2", ""])
def test_action_parse_names_bad_text(text):
    with pytest.raises(ValueError, match="cannot read action"):
        Action.parse(text)


# ---- generators ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,pp,m,v", GRID)
def test_every_generated_schedule_is_valid_and_complete(name, pp, m, v):
    s = build_schedule(name, pp, m, v)  # validates
    assert (s.pp, s.microbatches, s.virtual) == (pp, m, _expected_virtual(name, v))
    assert sorted(s.placement) == sorted(list(range(pp)) * s.virtual)
    computes = [a for acts in s.ranks for a in acts if a.is_compute]
    forwards = {(a.stage, a.microbatch) for a in computes if a.kind is Kind.F}
    assert forwards == set(itertools.product(range(pp * s.virtual), range(m)))
    split = {(a.stage, a.microbatch) for a in computes if a.kind is Kind.I}
    assert split == {(a.stage, a.microbatch) for a in computes if a.kind is Kind.W}
    full = {(a.stage, a.microbatch) for a in computes if a.kind is Kind.B}
    assert full | split == forwards and not full & split
    for rank, acts in enumerate(s.ranks):
        assert {s.placement[a.stage] for a in acts} <= {rank}
    if name in ("zb1", "zbv"):
        assert s.split_backward and not full
    if name in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"):
        assert not split


@pytest.mark.parametrize("name,pp,m,v", GRID[::3])
def test_csv_round_trip(name, pp, m, v):
    s = build_schedule(name, pp, m, v)
    text = s.to_csv()
    assert len(text.splitlines()) == pp
    back = Schedule.from_csv(text, name=name)
    assert (back.ranks, back.placement, back.virtual, back.microbatches) == \
        (s.ranks, s.placement, s.virtual, s.microbatches)


@pytest.mark.parametrize("name", [n for n in SCHEDULE_NAMES if n != "dualpipev"])
def test_compute_only_csv_gets_the_same_messages(name):
    s = build_schedule(name, 3, 6)
    compute = s.compute_only()
    assert all(a.is_compute for acts in compute.ranks for a in acts)
    assert Schedule.from_csv(compute.to_csv()).ranks == s.ranks


def test_placements():
    assert build_schedule("interleaved_1f1b", 3, 6, 2).placement == (0, 1, 2, 0, 1, 2)
    assert build_schedule("zbv", 3, 6).placement == (0, 1, 2, 2, 1, 0)
    assert build_schedule("dualpipev", 3, 6).stages_of(1) == (1, 4)


def test_steps_group_consecutive_messages():
    row = build_schedule("1f1b", 2, 2).ranks[0]
    assert [" ".join(map(str, step)) for step in steps(row)] == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1 0RECV_B0", "0B0", "0RECV_B1", "0B1"]


@pytest.mark.parametrize("name,pp,m,v", GRID[::2])
@pytest.mark.parametrize("keep", [True, False])
def test_engine_actions_follow_one_rule(name, pp, m, v, keep):
    """[Note: engine actions]: each stage of a rank gets one REDUCE_GRAD right before its last
    B or W and, kept gathered, one UNSHARD right before its first compute action and one
    RESHARD right after its last; the gathers they imply are gather_rounds'. The lists still
    validate and simulate to the same step (engine actions take no time)."""
    s = build_schedule(name, pp, m, v)
    ranks = tuple(add_engine_actions(acts, keep) for acts in s.ranks)
    for acts, plain in zip(ranks, s.ranks):
        assert [a for a in acts if not a.is_engine] == list(plain)
        for stage in {a.stage for a in plain}:
            mine = [a for a in acts if a.stage == stage and not a.is_comm]
            grads = [i for i, a in enumerate(mine) if a.kind in (Kind.B, Kind.W)]
            reduce = [i for i, a in enumerate(mine) if a.kind is Kind.REDUCE_GRAD]
            assert reduce == [grads[-1] - 1]
            kinds = [a.kind for a in mine]
            unshards = kinds.count(Kind.UNSHARD)
            assert unshards == kinds.count(Kind.RESHARD) == int(keep)
            if keep:
                assert kinds[0] is Kind.UNSHARD and kinds[-1] is Kind.RESHARD
            forwards = kinds.count(Kind.F)
            assert gather_rounds(keep, m) == (unshards or forwards)
    engine = Schedule(s.name, s.pp, s.microbatches, s.virtual, s.placement, ranks).validate()
    assert simulate(engine, Costs(f=1, b=2, i=1, w=1)).step_time == \
        simulate(s, Costs(f=1, b=2, i=1, w=1)).step_time


def test_v_bottom_hands_over_locally():
    s = build_schedule("zbv", 4, 8)
    comm = [a for a in s.ranks[3] if a.is_comm]
    assert all(a.stage in (3, 4) for a in comm)
    assert not [a for a in comm if (a.kind, a.stage) in ((Kind.SEND_F, 3), (Kind.RECV_F, 4),
                                                         (Kind.SEND_B, 4), (Kind.RECV_B, 3))]


def test_text_form():
    s = build_schedule("1f1b", 2, 2)
    text = s.to_text()
    assert text.splitlines()[0] == "schedule 1f1b: pp=2 microbatches=2 virtual=1 stages=2"
    assert text.splitlines()[1] == ("rank 0 (stage 0): 0F0 {0SEND_F0} 0F1 {0SEND_F1 0RECV_B0} 0B0 "
                                    "{0RECV_B1} 0B1")
    assert "{" not in s.to_text(comm=False) and str(s) == text


# ---- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize("name,close", [("interleaved", "interleaved_1f1b"), ("zbh1", "zb1"),
                                        ("dualpipe", "dualpipev"), ("1F1B", "1f1b"),
                                        ("gpip", "gpipe")])
def test_unknown_name_suggests_the_closest(name, close):
    with pytest.raises(ValueError, match=f"unknown pipeline schedule '{name}'; did you mean "
                                         f"'{close}'"):
        build_schedule(name, 2, 4)


def test_unknown_name_without_close_match_lists_all():
    with pytest.raises(ValueError, match="known: gpipe, 1f1b, interleaved_1f1b, zb1, zbv, "
                                         "dualpipev, looped_bfs") as err:
        build_schedule("chimera", 2, 4)
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_dualpipev_names_the_microbatches_it_needs(pp):
    with pytest.raises(ValueError, match=f"'dualpipev' with pp={pp} needs microbatches >= "
                                         f"{2 * pp}; got microbatches={2 * pp - 1}"):
        build_schedule("dualpipev", pp, 2 * pp - 1)


@pytest.mark.parametrize("name,virtual,match", [
    ("zbv", 3, "'zbv' runs exactly 2 stages per rank; got virtual=3"),
    ("dualpipev", 1, "'dualpipev' runs exactly 2 stages per rank; got virtual=1"),
    ("1f1b", 2, "'1f1b' runs exactly 1 stage per rank; got virtual=2.*interleaved_1f1b"),
    ("gpipe", 4, "'gpipe' runs exactly 1 stage per rank"),
    ("zb1", 2, "'zb1' runs exactly 1 stage per rank"),
    ("interleaved_1f1b", 1, "needs virtual >= 2 stages per rank; got virtual=1.*use 1f1b"),
    ("looped_bfs", -1, "virtual=-1: expected an integer >= 0"),
])
def test_invalid_virtual_is_refused(name, virtual, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(name, 2, 4, virtual)


@pytest.mark.parametrize("pp,m,match", [(0, 4, "pp=0"), (2, 0, "microbatches=0"),
                                        (True, 4, "pp=True"), (2, 2.0, "microbatches=2.0")])
def test_sizes_must_be_positive_integers(pp, m, match):
    with pytest.raises(ValueError, match=match):
        build_schedule("1f1b", pp, m)


# ---- validator -------------------------------------------------------------------------------
def _edit(s: Schedule, rank: int, actions) -> Schedule:
    ranks = list(s.ranks)
    ranks[rank] = tuple(actions)
    return Schedule(s.name, s.pp, s.microbatches, s.virtual, s.placement, tuple(ranks))


def _raises(s: Schedule, *fragments: str) -> str:
    with pytest.raises(ValueError) as err:
        validate_schedule(s)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return str(err.value)


def test_missing_forward_is_named():
    s = build_schedule("1f1b", 2, 3)
    row = [a for a in s.ranks[1] if a != Action(1, Kind.F, 2)]
    _raises(_edit(s, 1, row), "rank 1: 1F2 (forward of stage 1, micro-batch 2) is missing")


def test_duplicate_action_is_named():
    s = build_schedule("gpipe", 2, 2)
    _raises(_edit(s, 0, s.ranks[0] + (Action(0, Kind.B, 1),)), "0B1", "appears 2 times")


def test_missing_weight_gradient_is_named():
    s = build_schedule("zb1", 2, 2)
    row = [a for a in s.ranks[0] if a != Action(0, Kind.W, 1)]
    _raises(_edit(s, 0, row), "rank 0: stage 0, micro-batch 1 lacks 0W1")


def test_full_and_split_backward_together_are_refused():
    s = build_schedule("zb1", 2, 2)
    _raises(_edit(s, 0, s.ranks[0] + (Action(0, Kind.B, 0),)), "both a full backward (B) and "
                                                                 "a split one")


def test_weight_before_input_gradient_is_named():
    s = build_schedule("zb1", 2, 2)
    row = list(s.ranks[1])
    i, w = row.index(Action(1, Kind.I, 0)), row.index(Action(1, Kind.W, 0))
    row[i], row[w] = row[w], row[i]
    _raises(_edit(s, 1, row), "rank 1, action #", "1W0 (weight-gradient backward of stage 1, "
            "micro-batch 0) runs before 1I0, which it needs, earlier on rank 1")


def test_backward_before_its_gradient_arrives_is_named():
    s = build_schedule("1f1b", 2, 2)
    row = [a for a in s.ranks[0] if a != Action(0, Kind.RECV_B, 0)]
    row.insert(row.index(Action(0, Kind.B, 0)) + 1, Action(0, Kind.RECV_B, 0))
    _raises(_edit(s, 0, row), "0B0 (full backward of stage 0, micro-batch 0) runs before "
                              "0RECV_B0, which it needs, earlier on rank 0")


def test_local_stage_order_without_messages():
    """On one rank (pp=1) stage 1's forward needs stage 0's forward earlier in the list."""
    s = build_schedule("interleaved_1f1b", 1, 1, 2)
    assert all(a.is_compute for a in s.ranks[0])
    row = list(s.ranks[0])
    row[0], row[1] = row[1], row[0]
    _raises(_edit(s, 0, row), "1F0 (forward of stage 1, micro-batch 0) runs before 0F0")


def test_action_on_the_wrong_rank_is_named():
    s = build_schedule("1f1b", 2, 2)
    _raises(_edit(s, 0, s.ranks[0] + (Action(1, Kind.F, 0),)),
            "rank 0, action #", "stage 1 is placed on rank 1, not rank 0")


def test_text_instead_of_actions_is_named():
    s = build_schedule("1f1b", 2, 2)
    _raises(_edit(s, 0, s.ranks[0] + ("0F9",)), "rank 0, action #", "'0F9' is not an Action")


def test_out_of_range_micro_batch_is_named():
    s = build_schedule("1f1b", 2, 2)
    _raises(_edit(s, 0, s.ranks[0] + (Action(0, Kind.F, 7),)), "micro-batch 7 is out of range")


def test_link_order_mismatch_is_named():
    s = build_schedule("gpipe", 2, 3)
    row = list(s.ranks[1])
    a, b = row.index(Action(1, Kind.RECV_F, 0)), row.index(Action(1, Kind.RECV_F, 1))
    row[a], row[b] = row[b], row[a]
    row[a + 1], row[b + 1] = row[b + 1], row[a + 1]  # their forwards follow them
    _raises(_edit(s, 1, row), "link rank 0 -> rank 1: message #0 is 0SEND_F0", "1RECV_F1",
            "match in order")


def test_unsent_and_unreceived_messages_are_named():
    s = build_schedule("1f1b", 2, 2)
    no_send = [a for a in s.ranks[1] if a != Action(1, Kind.SEND_B, 1)]
    _raises(_edit(s, 1, no_send), "rank 0, action #", "0RECV_B1", "rank 1 never sends it")
    extra = list(s.ranks[0]) + [Action(0, Kind.SEND_F, 1)]
    _raises(_edit(s, 0, extra), "0SEND_F1", "rank 1 never receives it")


def test_message_between_stages_on_one_rank_is_refused():
    s = build_schedule("zbv", 2, 2)
    row = list(s.ranks[1])
    row.insert(row.index(Action(1, Kind.F, 0)) + 1, Action(1, Kind.SEND_F, 0))
    _raises(_edit(s, 1, row), "rank 1, action #", "1SEND_F0: no message is needed there")


def test_deadlock_is_named_with_the_waiting_ranks():
    # Rank 0 waits for the gradient of micro-batch 0 before it sends that micro-batch forward.
    text = "0F0,0RECV_B0,0B0,0SEND_F0\n1RECV_F0,1F0,1B0,1SEND_B0\n"
    with pytest.raises(DeadlockError) as err:
        Schedule.from_csv(text)
    msg = str(err.value)
    assert "deadlocks" in msg
    assert "rank 0 waits at action #1 0RECV_B0" in msg and "rank 1 is stuck at" in msg
    assert "rank 1 waits at action #0 1RECV_F0" in msg and "rank 0 is stuck at" in msg


# ---- user CSV --------------------------------------------------------------------------------
USER_CSV = """\
# pp=2, 4 micro-batches, 1F1B written by hand without messages (they are inserted)
0F0, 0F1, 0B0, 0F2, 0B1, 0F3, 0B2, 0B3
1F0, 1B0, 1F1, 1B1, 1F2, 1B2, 1F3, 1B3
"""


def test_user_csv_without_messages_is_completed_and_validated():
    s = Schedule.from_csv(USER_CSV, name="mine")
    assert (s.name, s.pp, s.microbatches, s.virtual, s.placement) == ("mine", 2, 4, 1, (0, 1))
    assert Action(0, Kind.SEND_F, 0) in s.ranks[0] and Action(1, Kind.RECV_F, 0) in s.ranks[1]
    assert s.ranks == build_schedule("1f1b", 2, 4).ranks


def test_user_csv_that_cannot_run_is_refused():
    bad = USER_CSV.replace("1F1, 1B1", "1B1, 1F1")
    with pytest.raises(ValueError, match=r"1B1 \(full backward of stage 1, micro-batch 1\) runs "
                                         r"before 1F1"):
        Schedule.from_csv(bad)


@pytest.mark.parametrize("text,match", [
    ("0F0,0Q0\n1F0\n", "CSV row 1 \\(rank 0\\), cell 2: cannot read action '0Q0'"),
    ("0F0,1F0\n1B0\n", "stage 1 has compute actions on rank 0 and on rank 1"),
    ("0F0,2F0\n1F0\n", "the CSV schedule has 3 stages over 2 ranks"),
    ("0F0,0B0\n2F0,2B0\n", "stages \\[1\\] have no compute actions"),
    ("# nothing\n\n", "empty"),
])
def test_unreadable_csv_is_named(text, match):
    with pytest.raises(ValueError, match=match):
        Schedule.from_csv(text)


def test_add_communication_refuses_lists_with_messages():
    s = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="rank 0 already has communication action 0SEND_F0"):
        add_communication(s.ranks, s.placement)


# ---- CLI -------------------------------------------------------------------------------------
def _cli(argv, capsys):
    from shardwise.train.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_show_writes_png_csv_and_prints_the_bubble(tmp_path, capsys):
    png, csv = tmp_path / "t.png", tmp_path / "t.csv"
    rc, out, _ = _cli(["schedule", "show", "1f1b", "--pp", "4", "--microbatches", "8",
                       "--out", str(png), "--csv", str(csv)], capsys)
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert csv.read_text() == build_schedule("1f1b", 4, 8).to_csv()
    assert "rank 3 | .. .. .. F0 B0 --" in out
    assert "bubble 3/11 = 27.3%" in out
    assert "published bubble (p-1)/(m+p-1) = 3/11 (equal)" in out
    assert "peak in-flight activations per rank (stage micro-batches, released by B or W): " \
           "4 3 2 1" in out


def test_cli_show_from_csv_with_costs(tmp_path, capsys):
    path = tmp_path / "mine.csv"
    path.write_text(USER_CSV)
    rc, out, _ = _cli(["schedule", "show", "--from-csv", str(path), "--costs", "f=1,b=2,comm=1/2",
                       "--actions"], capsys)
    assert rc == 0
    assert "schedule mine: pp=2 microbatches=4" in out and "{0SEND_F0}" in out
    assert "message=1/2" in out and "published bubble" not in out


@pytest.mark.parametrize("argv,message", [
    (["schedule", "show", "interleaved", "--pp", "4", "--microbatches", "8"],
     "did you mean 'interleaved_1f1b'"),
    (["schedule", "show", "dualpipev", "--pp", "4", "--microbatches", "6"],
     "needs microbatches >= 8"),
    (["schedule", "show", "zbv", "--pp", "4", "--microbatches", "8", "--virtual", "3"],
     "runs exactly 2 stages per rank"),
    (["schedule", "show", "1f1b", "--pp", "4"], "needs --microbatches"),
    (["schedule", "show", "1f1b", "--pp", "2", "--microbatches", "2", "--costs", "x=1"],
     "--costs item 'x=1'"),
    (["schedule", "show"], "needs a NAME"),
])
def test_cli_refusals_exit_2_with_the_reason(argv, message, capsys):
    rc, _, err = _cli(argv, capsys)
    assert rc == 2
    assert message in err


def test_cli_list_names_every_schedule(capsys):
    rc, out, _ = _cli(["schedule", "list"], capsys)
    assert rc == 0
    assert [line.split()[0] for line in out.splitlines()] == list(SCHEDULE_NAMES)
    assert "microbatches >= 2 x pp" in out


# ---- docs ------------------------------------------------------------------------------------
def test_docs_pipeline_examples_run(tmp_path, monkeypatch, capsys):
    """Every python block of docs/parallelism.md's pipeline section runs as written."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "parallelism.md").read_text()
    section = text.split("## Pipeline schedules", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, "docs/parallelism.md", "exec"), {})
    out = capsys.readouterr().out
    shown = re.search(r"```(?:text)?\n(schedule 'csv' .*?)\n```", section, re.S).group(1)
    assert shown in out  # the error quoted in the docs is the one users get
