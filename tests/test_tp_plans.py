"""Plans and accounting of tensor parallelism (issue 11).

* A Hugging Face Llama built from a config is parallelised from its ``base_model_tp_plan``
  (plus the causal-LM head's ``_tp_plan``) and trains like one process, at tp 2 and at tp 4
  with 2 KV heads (each copied to two tensor ranks).
* Plans: user globs, and ``ValueError``s naming a module the plan names that does not exist,
  a style that does not fit its module, an HF style with no mapping, sequence or loss
  parallelism an HF plan cannot give, heads not divisible by the degree.
* ``comm_stats`` labels the tensor- and sequence-parallel collectives, and their bytes per
  micro-batch equal Megatron's formulas (docs/parallelism.md, "Bytes per step").
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.distributed.comm import comm_stats, reset_comm_stats
from shardwise.models import build_model, get_model_config
from shardwise.testing import run_ranks
from shardwise.testing.parity import ParityConfig, make_batches, max_rel_err, reference_run
from shardwise.testing.tp_parity import TPConfig, mesh_for, tp_run

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 64


def build_hf(kv: int = 2):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=kv, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _hf_loss(model, tokens):
    logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


@functools.lru_cache(maxsize=None)
def _batches():
    return make_batches(seed=3, steps=STEPS, accum=1, global_batch=BATCH, seq_len=SEQ,
                        vocab=VOCAB)


def _hf_parity(tp: int, cache: dict):
    cfg = TPConfig(tp=tp, sp=False, loss_parallel=False, steps=STEPS, stage=3)
    layers = {transformers.models.llama.modeling_llama.LlamaDecoderLayer}
    return tp_run(build_hf, _batches(), cfg, layers, cache, logits_of=lambda out: out.logits)


class Toy(nn.Module):
    """Two feed-forward pairs under a ModuleList, for user plans."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(16, 32),
                                                   "down": nn.Linear(32, 16)})
                                    for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = h + b["down"](F.gelu(b["up"](h)))
        return self.head(h)


USER_PLAN = {"emb": "vocab", "blocks.*.up": "colwise", "blocks.*.down": "rowwise",
             "head": "colwise_output"}


def _errors(tp_mesh) -> list[str]:
    """The message of every plan mistake (each on a fresh model)."""
    cases = [
        lambda: shardwise.apply_tp(Toy(), tp_mesh, plan={"blocks.*.upp": "colwise"},
                                   sequence_parallel=False, loss_parallel=False),
        lambda: shardwise.apply_tp(Toy(), tp_mesh, plan={"blocks.*.up": "vocab"},
                                   sequence_parallel=False, loss_parallel=False),
        lambda: shardwise.apply_tp(Toy(), tp_mesh, plan={"blocks.*.up": "diagonal"},
                                   sequence_parallel=False, loss_parallel=False),
        lambda: shardwise.apply_tp(Toy(), tp_mesh, plan={"blocks.*.up": "colwise"},
                                   sequence_parallel=True, loss_parallel=False),
        lambda: shardwise.apply_tp(Toy(), tp_mesh, plan={"emb": "vocab"}, loss_parallel=False),
        lambda: shardwise.apply_tp(build_hf(), tp_mesh),
        lambda: shardwise.apply_tp(Toy(), tp_mesh),
    ]
    qwen = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8)
    cases.append(lambda: shardwise.apply_tp(transformers.Qwen3ForCausalLM(qwen), tp_mesh,
                                            sequence_parallel=False, loss_parallel=False))
    heads = get_model_config("debug", dim=48, n_heads=3, n_kv_heads=3, vocab_size=VOCAB)
    cases.append(lambda: shardwise.apply_tp(build_model(heads, device="meta"), tp_mesh))
    out = []
    for case in cases:
        try:
            case()
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
    return out


def _user_plan_trains(mesh) -> float:
    """The toy model under the user plan gives the unsplit model's loss and gradient norm."""
    torch.manual_seed(0)
    ref = Toy()
    torch.manual_seed(0)
    tp_mesh = mesh["tp"]
    model = shardwise.apply_tp(Toy(), tp_mesh, plan=USER_PLAN, sequence_parallel=True)
    try:
        shardwise.shard(model, stage=2)  # over the world: the tensor ranks as data ranks
    except ValueError as exc:
        assert "pass mesh=<the ParallelMesh>" in str(exc)
    else:
        raise AssertionError("sharding over the tensor ranks was not refused")
    shardwise.shard(model, stage=2, mesh=mesh)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    loss = shardwise.vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], tp_mesh)
    loss.backward()
    ref_loss = F.cross_entropy(ref(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    ref_loss.backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    norm = shardwise.get_total_norm(model)
    mem = shardwise.memory_report(model)  # one region's gathered input: 2 x 8 x 16 fp32
    assert (mem.tp_comm_bytes, mem.peak_tp_comm_bytes) == (0, 2 * 8 * 16 * 4), mem
    return max(abs(loss.item() - ref_loss.item()) / ref_loss.item(),
               abs(norm.item() - ref_norm.item()) / ref_norm.item())


LL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=16,
          multiple_of=16)


def _bytes(tp_mesh, sp: bool) -> dict[str, tuple[int, int]]:
    """``{label: (calls, bytes sent)}`` of one forward + backward (batch 2 x 8 tokens)."""
    model = build_model(get_model_config("debug", **LL), seed=0)
    shardwise.apply_tp(model, tp_mesh, sequence_parallel=sp)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    reset_comm_stats()
    shardwise.vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], tp_mesh).backward()
    stats = comm_stats()
    return {k: (v.calls, v.bytes_sent) for k, v in stats.by_label.items()
            if k.startswith(("tp_", "sp_"))}


def _worker(world: int):
    cache: dict = {}
    out = {"hf": _hf_parity(world, cache)}
    if world == 2:
        mesh = mesh_for(TPConfig(tp=2), cache)
        out["errors"] = _errors(mesh["tp"])
        out["user"] = _user_plan_trains(mesh)
    tp_mesh = mesh_for(TPConfig(tp=world), cache)["tp"]
    out["bytes"] = {sp: _bytes(tp_mesh, sp) for sp in (False, True)}
    return out


@functools.lru_cache(maxsize=None)
def _hf_reference():
    return reference_run(build_hf, _batches(), ParityConfig(stage=0, steps=STEPS),
                         loss_fn=_hf_loss)


def _megatron(t: int, sp: bool) -> dict[str, tuple[int, int]]:
    """Megatron's per-micro-batch TP / SP traffic of this model, per rank (bytes sent by the
    ring algorithms, comm.py's [Note: byte accounting]): ``a = B * T * C * 4`` bytes of
    activations; L layers, each with two regions (attention, MLP), plus the embedding and
    the LM head; ``n = B * T`` tokens for the loss."""
    layers, a, n = 2, 2 * 8 * 32 * 4, 2 * 8
    ring = (t - 1) * a // t
    loss = {"tp_loss_max": (1, 2 * (t - 1) * n * 4 // t),
            "tp_loss_sum": (1, 2 * (t - 1) * 2 * n * 4 // t)}
    if not sp:  # g forward (embedding, 2 per layer), f backward (2 per layer, LM head)
        return {"tp_g_all_reduce": (2 * layers + 1, (2 * layers + 1) * 2 * ring),
                "tp_f_all_reduce": (2 * layers + 1, (2 * layers + 1) * 2 * ring), **loss}
    regions = 2 * layers + 1  # entries (2 per layer + the head) = exits (2 per layer + emb)
    return {"sp_all_gather": (2 * regions, 2 * regions * ring),
            "sp_reduce_scatter": (2 * regions, 2 * regions * ring),
            "sp_regather": (regions, regions * ring), **loss}


@pytest.mark.parametrize("world", [2, 4])
def test_hf_plans_user_plans_and_bytes(world):
    results = run_ranks(_worker, world, args=(world,), timeout_s=600)
    ref = _hf_reference()
    hf = results[0]["hf"]
    weight_err, where = max_rel_err(hf.state, ref.state)
    loss_err = max(abs(a - b) / b for a, b in zip(hf.losses, ref.losses))
    norm_err = max(abs(a - b) / b for a, b in zip(hf.grad_norms, ref.grad_norms))
    assert loss_err < 1e-5 and norm_err < 1e-6 and weight_err < 1e-5, \
        (loss_err, norm_err, weight_err, where)
    for r in results:
        for sp in (False, True):
            assert r["bytes"][sp] == _megatron(world, sp), (sp, r["bytes"][sp])
    if world != 2:
        return
    assert results[0]["user"] < 1e-6
    errors = results[0]["errors"]
    expected = [
        "plan entry 'blocks.*.upp' (colwise) matches no module of Toy",
        "style 'vocab' does not fit module blocks.0.up (Linear): it needs an nn.Embedding",
        "plan entry 'blocks.*.up': unknown style 'diagonal'",
        "sequence_parallel=True needs a vocab-parallel embedding",
        "with sequence_parallel=True every parameter needs a style",
        "the Hugging Face plan of LlamaForCausalLM supports neither sequence_parallel",
        "Toy has no built-in tensor-parallel plan",
        "Hugging Face tensor-parallel style 'replicated_with_grad_allreduce'",
        "n_heads=3 is not divisible by tp=2",
    ]
    assert len(errors) == len(expected)
    for got, want in zip(errors, expected):
        assert want in got, (want, got)
