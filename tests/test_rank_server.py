"""The rank server (shardwise/train/rank_server.py): local ranks fork from a server that
imported their module once, unless the process already runs someone else's forkserver, whose
forks would print where that server's owner printed when it started."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import multiprocessing, os
    from multiprocessing import forkserver
    from shardwise.train.launch import _rank_main
    from shardwise.train.rank_server import start_rank_server, stop_rank_server

    def pid():
        return forkserver._forkserver._forkserver_pid

    assert pid() is None
    assert start_rank_server(_rank_main) == "forkserver"
    ours = pid()
    assert ours is not None
    assert forkserver._forkserver._preload_modules == ["shardwise.train.rank_server",
                                                      "shardwise.train.launch"]
    assert start_rank_server(_rank_main) == "forkserver" and pid() == ours  # started once
    stop_rank_server()
    assert pid() is None  # stopped and reaped
    stop_rank_server()  # a second stop is a no-op

    # someone else's server (a test harness's): left running, the ranks spawn
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["json"])
    forkserver.ensure_running()
    theirs = pid()
    assert start_rank_server(_rank_main) == "spawn"
    stop_rank_server()
    assert pid() == theirs and forkserver._forkserver._preload_modules == ["json"]
    print("ok")
""")


def test_the_server_is_ours_to_start_and_stop_and_a_foreign_one_is_left_alone():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
