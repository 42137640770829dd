"""shardwise.shard on real Gloo ranks: what users see, and every refusal's message."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.testing import run_ranks
from shardwise.testing.parity import (ParityConfig, make_batches, max_rel_err, reference_run,
                                      sharded_run)

LLAMA = dict(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
             multiple_of=16)


def build_llama():
    return build_model(get_model_config("debug", **LLAMA), seed=0)


def _loss(model, tokens):
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


# ---------------------------------------------------------------- what users see
def _user_view_worker():
    rank, world = dist.get_rank(), dist.get_world_size()
    before = {n: p.shape for n, p in build_llama().named_parameters()}
    facts = {}
    for stage in (0, 1, 2, 3):
        model = shardwise.shard(build_llama(), stage=stage, wrap={TransformerBlock})
        after = {n: p.shape for n, p in model.named_parameters()}
        facts[f"names{stage}"] = list(after) == list(before)
        ok = True
        for n, shape in before.items():
            chunk = -(-shape[0] // world)
            rows = max(0, min(chunk, shape[0] - rank * chunk)) if stage else shape[0]
            ok &= after[n] == torch.Size([rows, *shape[1:]])
        facts[f"shapes{stage}"] = ok
        decay = [p for p in model.parameters() if p.ndim >= 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": [p for p in model.parameters() if p.ndim < 2],
                                  "weight_decay": 0.0}], lr=1e-3)
        tokens = make_batches(0, 1, 1, 2 * world, 8, 64)[0, 0, 2 * rank:2 * rank + 2]
        _loss(model, tokens).backward()
        facts[f"grads_shard_shaped{stage}"] = all(
            p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(tokens[:, :-1])
        rep = shardwise.memory_report(model, opt)
        facts[f"unsharded_after_eval{stage}"] = rep.unsharded_bytes
        shardwise.reset_comm_stats()
        with shardwise.no_sync(model):
            _loss(model, tokens).backward()
        s = shardwise.comm_stats()
        facts[f"no_sync_reduce_bytes{stage}"] = s["reduce_scatter"].bytes_sent + \
            s["all_reduce"].bytes_sent
        facts[f"no_sync_gather_bytes{stage}"] = s["all_gather"].bytes_sent
    return facts


@pytest.mark.parametrize("world", [3])
def test_user_view_names_shapes_optimizers_no_sync(world):
    facts = run_ranks(_user_view_worker, world)
    for rank, f in enumerate(facts):
        for stage in (0, 1, 2, 3):
            assert f[f"names{stage}"], (rank, stage)
            assert f[f"shapes{stage}"], (rank, stage)
            assert f[f"grads_shard_shaped{stage}"], (rank, stage)
            assert f[f"no_sync_reduce_bytes{stage}"] == 0, (rank, stage)
            if stage < 3:  # parameters are whole between steps: nothing to gather
                assert f[f"no_sync_gather_bytes{stage}"] == 0, (rank, stage)
        assert f["unsharded_after_eval3"] == 0  # eval forward frees gathered parameters


# ---------------------------------------------------------------- variants still match
def _variants_worker(batches, cfgs):
    return [sharded_run(build_llama, batches, c, wrap={TransformerBlock}) for c in cfgs]


def test_prefetch_and_reshard_variants_match_reference():
    cfgs = [ParityConfig(stage=3, prefetch=0), ParityConfig(stage=3, prefetch=2),
            ParityConfig(stage=3, reshard_after_forward=False),
            ParityConfig(stage=2, prefetch=0)]
    batches = make_batches(3, 5, 1, 6, 8, 64)
    ref = reference_run(build_llama, batches, cfgs[0])
    for cfg, res in zip(cfgs, run_ranks(_variants_worker, 2, args=(batches, cfgs))[0]):
        assert max(abs(a - b) / b for a, b in zip(res.losses, ref.losses)) < 1e-5, cfg.name
        assert max_rel_err(res.state, ref.state)[0] < 1e-5, cfg.name


class _Twin(nn.Module):
    """Two blocks; block ``b`` is sometimes skipped, one is checkpointed from outside."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.a = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.never = nn.Sequential(nn.Linear(6, 6))
        self.out = nn.Linear(6, 3)

    def forward(self, x, use_b: bool):
        h = checkpoint(self.a, self.inp(x), use_reentrant=False)
        if use_b:
            h = self.b(h)
        return self.out(h)


def _twin_worker(stage):
    torch.manual_seed(0)
    model = _Twin()
    ref = _Twin()
    ref.load_state_dict(model.state_dict())
    shardwise.shard(model, stage=stage, wrap={nn.Sequential})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.randn(2 * world, 4, generator=g)
        use_b = step != 1
        model(x[2 * rank:2 * rank + 2], use_b).sum().div(2 * world).mul(world).backward()
        opt.step()
        opt.zero_grad()
        ref(x, use_b).sum().div(2 * world).backward()
        for p in ref.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ropt.step()
        ropt.zero_grad()
    full = shardwise.full_state_dict(model)
    return max_rel_err(full, ref.state_dict())


@pytest.mark.parametrize("stage", [0, 3])
def test_outer_checkpoint_skipped_and_never_used_units(stage):
    for err, where in run_ranks(_twin_worker, 2, args=(stage,)):
        assert err < 1e-6, where


def _composed_worker():
    model = build_llama()
    group = dist.new_group(list(range(dist.get_world_size())))
    for layer in model.layers:  # children first, each over its own group, stage 3
        shardwise.shard(layer, stage=3, mesh=group)
    shardwise.shard(model, stage=1)
    state = model._shardwise_state
    own = {sp.fqns[0] for u in state.units for sp in u.params}
    batches = make_batches(4, 3, 1, 2 * dist.get_world_size(), 8, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rank = dist.get_rank()
    for step in range(3):
        _loss(model, batches[step, 0, 2 * rank:2 * rank + 2]).backward()
        shardwise.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    return own, shardwise.full_state_dict(model)


def test_composed_children_keep_their_own_sharding():
    out = run_ranks(_composed_worker, 2)
    own, full = out[0]
    assert own == {"tok_embeddings.weight", "norm.weight", "output.weight"}
    batches = make_batches(4, 3, 1, 4, 8, 64)
    ref = reference_run(build_llama, batches, ParityConfig(stage=0, steps=3))
    err, where = max_rel_err(full, ref.state)
    assert err < 1e-5, where


# ---------------------------------------------------------------- refusals
class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x):
        return self.b(self.a(x))


class _NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3, 3))


@pytest.mark.parametrize("kwargs, message", [
    (dict(stage=4), "stage must be 0, 1, 2 or 3, got 4"),
    (dict(prefetch=-1), "prefetch must be an int >= 0 (units gathered ahead), got -1"),
    (dict(wrap="Linear"), "wrap must be None, a module class, a set of classes or a callable"),
    (dict(wrap={int}), "wrap must hold nn.Module subclasses, got [<class 'int'>]"),
    (dict(bucket_mb=0), "bucket_mb must be > 0, got 0"),
    (dict(stage=0, materialize=False), "materialize=False (planning on the meta device) needs"),
    (dict(mesh=object()), "a mesh was given but torch.distributed is not initialised"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError) as e:
        shardwise.shard(_Plain(), **kwargs)
    assert message in str(e.value)


def test_unshardable_parameters_are_named():
    m = _Plain()
    m.b.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"unit <root> mixes parameter dtypes: a.weight "
                                         r"\(torch.float32\), b.weight \(torch.bfloat16\)"):
        shardwise.shard(m)
    m = _Plain()
    m.steps = nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False)
    with pytest.raises(ValueError, match="parameter steps of unit <root> has dtype torch.int64"):
        shardwise.shard(m)
    m = _Plain()
    m.a.to_empty(device="meta")
    with pytest.raises(ValueError, match="parameter b.weight is not on the meta device but "
                                         "a.weight is"):
        shardwise.shard(m)
    with torch.device("meta"):
        bad = _NoReset()
    with pytest.raises(ValueError, match="module _NoReset has meta-device tensors but no "
                                         "reset_parameters"):
        shardwise.shard(bad)


def test_misuse_after_sharding_is_named():
    m = shardwise.shard(_Plain(), stage=2)
    with pytest.raises(ValueError, match="module _Plain is already sharded; shard it once"):
        shardwise.shard(m)
    with pytest.raises(ValueError, match="no_sync needs a module passed to shardwise.shard, "
                                         "got an unsharded _Plain"):
        with shardwise.no_sync(_Plain()):
            pass
    with pytest.raises(ValueError, match="memory_report needs a module passed to"):
        shardwise.memory_report(_Plain())
    with pytest.raises(ValueError, match="max_norm must be > 0, got 0"):
        shardwise.clip_grad_norm_(m, 0)
    with torch.device("meta"):
        planned = _Plain()
    shardwise.shard(planned, stage=3, materialize=False)
    with pytest.raises(ValueError, match="sharded on the meta device with materialize=False"):
        planned(torch.zeros(1, 3))


# ----------------------------------------------------------------- the engine's contracts
def _replicate_worker():
    """``replicate`` and ``shard(stage=0)`` are one call: bitwise the same training, with
    buckets and (a compute dtype) as units; both states offer the EngineState contract."""
    from shardwise.shard import EngineState, engine_states

    out = {}
    for name, mp in (("buckets", None), ("units", shardwise.MixedPrecision(torch.bfloat16))):
        weights = []
        for make in (lambda m, mp=mp: shardwise.replicate(m, wrap={TransformerBlock},
                                                          mixed_precision=mp),
                     lambda m, mp=mp: shardwise.shard(m, stage=0, wrap={TransformerBlock},
                                                      mixed_precision=mp)):
            model = make(build_model(get_model_config("debug", n_layers=2, dim=32, n_heads=4,
                                                      n_kv_heads=2), seed=0))
            state = engine_states(model)[0]
            for field in EngineState.__annotations__:
                assert hasattr(state, field), (name, field)
            for method in ("graph_parameters", "param_rows", "unshard_all", "reshard_all",
                           "mark_stale", "remove"):
                assert callable(getattr(state, method)), (name, method)
            assert state.policy.zero == 0 and bool(state.units) == (name == "units")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(dist.get_rank())
            for _ in range(2):
                _loss(model, torch.randint(0, 256, (2, 17), generator=g)).backward()
                opt.step()
                opt.zero_grad()
            weights.append({k: v.clone() for k, v in model.state_dict().items()})
        out[name] = all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    return out


def test_replicate_is_shard_stage_0_and_both_states_keep_the_contract():
    results = run_ranks(_replicate_worker, 2, timeout_s=120)
    assert results[0] == results[1] == {"buckets": True, "units": True}


@pytest.mark.parametrize("stage, booleans", [
    (0, (False, False, False)), (1, (True, False, False)), (2, (True, True, False)),
    (3, (True, True, True))])
def test_the_stage_is_a_policy_of_booleans(stage, booleans):
    from shardwise.shard import ZeroPolicy

    policy = ZeroPolicy.from_stage(stage)
    assert (policy.shard_optimizer, policy.shard_grads, policy.shard_params) == booleans
    assert policy.zero == stage and policy.reduce_at_end == (stage == 1)
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3, got 4"):
        ZeroPolicy.from_stage(4)
