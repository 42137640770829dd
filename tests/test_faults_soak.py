"""The soak benchmark (bench/soak.py), short: 4 ranks, a checkpoint every 2 steps, three
random faults (one of them a hang the watchdog must end), relaunched until the job finishes
with exactly the weights and optimizer state of a clean run."""

from __future__ import annotations

from bench.soak import SoakConfig, plan_faults, soak


def test_fault_plans_are_ordered_and_hit_saving_steps():
    for seed in range(20):
        cfg = SoakConfig(steps=300, interval=10, faults=6, seed=seed)
        faults = plan_faults(cfg)
        steps = [int(f.split(":step=")[1].split(":")[0]) for f in faults]
        assert steps == sorted(set(steps)) and 1 < steps[0] and steps[-1] < 300
        assert [f.split("attempt=")[1] for f in faults] == [str(i) for i in range(len(faults))]
        for f, step in zip(faults, steps):
            if ":phase=checkpoint" in f or ":phase=commit" in f:
                assert step % 10 == 0, f


def test_a_short_soak_survives_every_fault_and_ends_with_the_clean_weights(tmp_path):
    cfg = SoakConfig(steps=12, nproc=4, interval=2, faults=3, seed=1, timeout_s=4.0,
                     launcher="ranks")
    out = soak(cfg, tmp_path)
    assert [a["ended"] == "finished" for a in out.attempts] == [False] * len(out.faults) + [True]
    for fault, attempt in zip(out.faults, out.attempts):
        rank = fault.split(":rank=")[1].split(":")[0]
        if fault.startswith("kill"):  # the launcher names the dead rank first...
            assert attempt["ended"].startswith(f"_train failed on rank {rank} of 4 first")
        if fault.startswith("hang"):  # ...and the watchdog the hanging one
            assert attempt["report"].endswith(f"rank {rank} never issued it"), attempt
    assert out.equal, "the weights differ from the clean run's"
    assert out.verified[-1] == "step_00000012"
