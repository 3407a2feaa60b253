"""Split mode "tensor" (models/tensor_split.py): every layer's heads and rows divided among RPC
servers that compute each step together - the same logits, bit for bit, as one device, over
two and three servers, uneven shares, a KV head shared by devices, biases and q/k norms, from
the servers' own copies of the file; the plan's arithmetic; and clear refusals."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

import pyggml as pg
from pyggml.models import hub
from pyggml.models import PlacementError
from pyggml.models.hparams import HParams
from pyggml.models.tensor_split import Shard, SplitError, cuts, plan_tensor_split, shard_rows

from tests.conftest import shared_model
from tests.models.synthetic import Shape, random_weights, reference_logits, write_model
from tests.rpc.test_rpc_models import prompt_ids


def hparams(n_head: int, n_head_kv: int, n_embd: int = 576, n_ff: int = 1536, n_expert: int = 0) -> HParams:
    return HParams(arch="llama", n_vocab=100, n_ctx_train=2048, n_embd=n_embd, n_layer=2, n_head=n_head,
                   n_head_kv=n_head_kv, n_embd_head_k=64, n_embd_head_v=64, n_ff=n_ff, norm_eps=1e-5, rope_dims=64,
                   rope_freq_base=1e4, rope_freq_scale=1.0, rope_freq_base_swa=1e4, n_expert=n_expert)


def test_cuts_share_in_proportion_and_give_everyone_one():
    assert cuts(9, [1, 1]) == [(0, 5), (5, 9)]
    assert cuts(3, [3, 1]) == [(0, 2), (2, 3)]
    assert cuts(4, [100, 1, 1]) == [(0, 2), (2, 3), (3, 4)]  # at least one each, however small the share
    assert cuts(1536, [3, 1]) == [(0, 1152), (1152, 1536)]
    # in whole units where the rows are whole units (Q4_K's repacked eights; the hidden rows'
    # 32s), row by row where they are not
    assert cuts(640, [1, 1, 1], 8) == [(0, 216), (216, 432), (432, 640)]
    assert cuts(2048, [1, 1, 1], 32) == [(0, 704), (704, 1376), (1376, 2048)]
    assert cuts(20, [1, 1], 8) == [(0, 10), (10, 20)]
    assert cuts(2056, [1, 1, 1], 32) == [(0, 688), (688, 1376), (1376, 2056)]  # not 32s: in eights
    with pytest.raises(SplitError, match="2 units cannot be shared among 3"):
        cuts(2, [1, 1, 1])


@pytest.mark.parametrize("n, weights", [(17, [1, 1]), (100, [1, 1, 1, 1, 1]), (161, [3, 1]), (1001, [1, 1, 1])])
def test_rows_not_in_eights_are_cut_into_shares_not_in_eights(n, weights):
    """A Q4_K matrix whose rows are not a multiple of 8 is not repacked, and a share of it that
    is would be (other kernels, other bits): such rows are cut with no share a multiple of 8,
    and each share's product then gives the whole's rows, bit for bit."""
    from tests.cpu.test_mul_mat import weight
    shares = cuts(n, weights, 8)
    assert shares[0][0] == 0 and shares[-1][1] == n and all(b - a >= 1 and (b - a) % 8 for a, b in shares)
    if n > 200:
        return
    w, _, raw = weight(pg.Type.Q4_K, n, 256, seed=n)
    x = pg.new_tensor(pg.Type.F32, (256, 3), "x").set_input()
    xv = np.random.default_rng(n).standard_normal((3, 256)).astype(np.float32)
    from tests.conftest import run_graph
    whole = run_graph(pg.ops.mul_mat(w, x), {x: xv})[0, 0]
    for a, b in shares:
        part = pg.new_tensor(pg.Type.Q4_K, (256, b - a), "part")
        pg.alloc_tensors([part], pg.cpu_device().get_buffer_type())
        pg.tensor_set(part, np.ascontiguousarray(raw[a:b]))
        assert np.array_equal(run_graph(pg.ops.mul_mat(part, x), {x: xv})[0, 0], whole[:, a:b])


def test_heads_split_on_whole_groups_or_share_a_kv_head():
    # SmolLM2: 9 query heads in 3 groups - whole groups, the KV heads with them
    two = plan_tensor_split(hparams(9, 3), [0, 1], [1, 1])
    assert [(s.q_heads, s.kv_heads) for s in two] == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    three = plan_tensor_split(hparams(9, 3), [0, 1, 2], [1, 1, 1])
    assert [(s.q_heads, s.kv_heads) for s in three] == [((0, 3), (0, 1)), ((3, 6), (1, 2)), ((6, 9), (2, 3))]
    # Gemma 3 270M: 4 query heads and one KV head - every device holds it
    gemma = plan_tensor_split(hparams(4, 1, 640, 2048), [0, 1, 2], [1, 1, 1])
    assert [(s.q_heads, s.kv_heads) for s in gemma] == [((0, 2), (0, 1)), ((2, 3), (0, 1)), ((3, 4), (0, 1))]
    assert [s.ff_rows for s in gemma] == [(0, 704), (704, 1376), (1376, 2048)]
    assert [s.embd_rows for s in gemma] == [(0, 216), (216, 432), (432, 640)]
    with pytest.raises(SplitError, match="cannot share 4 query heads"):
        plan_tensor_split(hparams(4, 1, 640, 2048), list(range(5)), [1.0] * 5)
    # a mixture of experts: every expert's hidden rows, in the same shares
    moe = dataclasses.replace(hparams(4, 1, n_expert=8), n_expert_used=2, n_ff_exp=768)
    assert [s.ff_exp_rows for s in plan_tensor_split(moe, [0, 1], [3, 1])] == [(0, 576), (576, 768)]


def test_each_weight_has_its_rows():
    hp = hparams(9, 3)
    s = Shard(1, (6, 9), (2, 3), (768, 1536), (288, 576), (50, 100))
    assert shard_rows("blk.3.attn_q.weight", s, hp) == (384, 576)
    assert shard_rows("blk.3.attn_k.weight", s, hp) == (128, 192)
    assert shard_rows("blk.3.attn_v.bias", s, hp) == (128, 192)
    assert shard_rows("blk.3.attn_output.weight", s, hp) == (288, 576)
    assert shard_rows("blk.3.ffn_up.weight", s, hp) == (768, 1536)
    assert shard_rows("blk.3.ffn_down.weight", s, hp) == (288, 576)
    assert shard_rows("blk.3.attn_norm.weight", s, hp) is None
    assert shard_rows("token_embd.weight", s, hp) is None
    assert shard_rows("output.weight", s, hp) == (50, 100)
    moe = Shard(1, (6, 9), (2, 3), (768, 1536), (288, 576), (50, 100), (384, 768))
    assert shard_rows("blk.3.ffn_gate_exps.weight", moe, hp) == (384, 768)
    assert shard_rows("blk.3.ffn_up_exps.bias", moe, hp) == (384, 768)
    assert shard_rows("blk.3.ffn_down_exps.weight", moe, hp) == (288, 576)
    assert shard_rows("blk.3.attn_sinks.weight", moe, hp) == (6, 9)
    assert shard_rows("blk.3.ffn_gate_inp.weight", moe, hp) is None  # the router: every device's


def test_a_stack_of_experts_is_cut_in_one_piece_per_expert():
    """Rows of every expert's matrix (one piece of the file per expert, an expert's size apart),
    elements of every expert's bias, a vector's elements."""
    from pyggml.models.tensor_split import FileSlice, shard_tensor
    stack = pg.Tensor(pg.Type.Q8_0, (64, 48, 6), name="blk.0.ffn_up_exps.weight")
    part, where = shard_tensor(stack, (24, 48))
    row = pg.Type.Q8_0.row_size(64)
    assert part.ne[:3] == (64, 24, 6)
    assert where == FileSlice(stack.name, 24 * row, 6 * 24 * row, 6, 48 * row)
    bias = pg.Tensor(pg.Type.F32, (48, 6), name="blk.0.ffn_up_exps.bias")
    part, where = shard_tensor(bias, (0, 24))
    assert part.ne[:2] == (24, 6) and where == FileSlice(bias.name, 0, 6 * 24 * 4, 6, 48 * 4)
    sinks = pg.Tensor(pg.Type.F32, (8,), name="blk.0.attn_sinks.weight")
    part, where = shard_tensor(sinks, (2, 5))
    assert part.ne[0] == 3 and where == FileSlice(sinks.name, 8, 12)


def decode_step(m: pg.Model):
    """The split graph of a one-token step that the model's context built."""
    return next(b for shape, b in m.context._graphs.items() if shape[0] == 1)


def wire_bytes(hp, shard, blocks: dict[str, pg.Type]) -> int:
    """What a device that is not the lead receives per token, reckoned from the shapes: the
    other devices' rows of each gathered slice (in ``blocks``' type where given, else float32),
    and the embedding's row."""
    def size(kind: str, rows: int) -> int:
        t = blocks.get(kind, pg.Type.F32)
        return rows // t.block_size * t.type_size
    heads = (hp.n_head - (shard.q_heads[1] - shard.q_heads[0])) * hp.n_embd_head_v
    ff = hp.n_ff - (shard.ff_rows[1] - shard.ff_rows[0])
    embd = hp.n_embd - (shard.embd_rows[1] - shard.embd_rows[0])
    return hp.n_layer * (size("kqv_out", heads) + size("ffn_act", ff) + 2 * size("", embd)) + 4 * hp.n_embd


def assert_sent_in_blocks(m: pg.Model, expect_blocks: set[str]) -> None:
    """The slices that feed a product (``expect_blocks``: which of kqv_out, ffn_act) go in the
    blocks that product's weight quantizes them to, the others as float32, and a device
    receives the bytes the shapes give."""
    step, weights, hp = decode_step(m), m.model.shard_weights[0], m.model.hp
    sent = {key: t.type for t, _, key in step.exchange.wanted}
    reads = {"kqv_out": "attn_output", "ffn_act": "ffn_down"}
    for il in range(hp.n_layer):
        for kind, product in reads.items():
            want = weights[f"blk.{il}.{product}.weight"].type.vec_dot_type if kind in expect_blocks else pg.Type.F32
            assert sent[f"{kind}-{il}"] == want, (kind, il)
        assert sent[f"attn_out-{il}"] == sent[f"ffn_out-{il}"] == pg.Type.F32
    blocks = {kind: weights[f"blk.0.{reads[kind]}.weight"].type.vec_dot_type for kind in expect_blocks}
    assert m.context.exchanged_bytes()[1] == wire_bytes(hp, m.model.shards[1], blocks)


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_two_servers_give_the_local_logits_and_text(alias, rpc_pair):
    local = shared_model(alias)
    ids = prompt_ids(alias)
    with pg.Model(alias, n_ctx=256, rpc=[s.endpoint for s in rpc_pair], split_mode="tensor",
                  progress=False) as m:
        assert m.model.shards is not None and len(m.model.shards) == 2
        got = m.logits(ids)
        assert np.array_equal(got, local.logits(ids)), np.abs(got - local.logits(ids)).max()
        # decoding token by token, top-k sampling's path included, and with a penalty (the
        # history's logits come from the device whose rows of the head hold them)
        assert list(m.generate(ids[:12], max_tokens=12, temperature=0)) == \
            list(local.generate(ids[:12], max_tokens=12, temperature=0))
        assert list(m.generate(ids[:12], max_tokens=12, temperature=0, repeat_penalty=1.5)) == \
            list(local.generate(ids[:12], max_tokens=12, temperature=0, repeat_penalty=1.5))
        # the head is split by vocabulary rows: the top k of both devices' top k is one device's
        n_vocab = local.n_vocab
        hist = np.array([[0, 7, n_vocab // 2 - 1, n_vocab // 2, n_vocab - 1, ids[3]]], dtype=np.int32)
        tops = []
        for model in (m, local):
            model.context.clear()
            tops.append(model.context.eval_prefix(ids, n_top=40, hist=hist))
        for part in ("ids", "values", "hist_values"):
            assert np.array_equal(getattr(tops[0], part), getattr(tops[1], part)), part
        # the heads' outputs and the hidden rows went in the blocks their products take
        # (SmolLM2's Q4_1: Q8_1; Gemma's K-quants: Q8_K), the logits above bit-identical
        assert_sent_in_blocks(m, {"kqv_out", "ffn_act"})


def test_three_servers_and_uneven_shares(rpc_pair, start_server):
    local = shared_model("smollm2")
    ids = prompt_ids("smollm2")
    want = local.logits(ids)
    endpoints = [s.endpoint for s in rpc_pair] + [start_server().endpoint]
    plans = []
    with pg.Model("smollm2", n_ctx=256, rpc=endpoints, split_mode="tensor", progress=False,
                  on_plan=plans.append) as m:
        assert np.array_equal(m.logits(ids), want)
    assert "heads 0-2 (kv 0)" in plans[0] and "heads 6-8 (kv 2)" in plans[0]
    with pg.Model("smollm2", n_ctx=256, rpc=endpoints[:2], split_mode="tensor", tensor_split="3,1",
                  progress=False) as m:
        assert [s.ff_rows for s in m.model.shards] == [(0, 1152), (1152, 1536)]
        assert np.array_equal(m.logits(ids), want)
    # Gemma 3 over three: four query heads over one KV head (2, 1, 1 of them, each a whole Q8_K
    # block of 256 values), its 2048 hidden rows as 704, 672 and 672 - not whole Q8_K blocks, so
    # those go as float32; its 640 rows of the projections in eights (216, 216, 208: Q4_K's
    # repacked kernels, as the whole's)
    gemma, ids = shared_model("gemma3-270m"), prompt_ids("gemma3-270m")
    with pg.Model("gemma3-270m", n_ctx=256, rpc=endpoints, split_mode="tensor", progress=False) as m:
        assert [s.ff_rows for s in m.model.shards] == [(0, 704), (704, 1376), (1376, 2048)]
        assert np.array_equal(m.logits(ids), gemma.logits(ids))
        m.context.clear()
        m.context.decode(ids[:4])
        m.context.decode([ids[4]])
        assert_sent_in_blocks(m, {"kqv_out"})


def test_failover_mid_generation_gives_the_same_text(start_server, caplog):
    """Three servers split every layer; one is killed mid-generation: the plan is made anew
    over the two left, the cache rebuilt from its history, and the greedy text is one device's.
    Every server sends slices to every other, so the ones left stop waiting for the lost one's
    at once (a server whose link went fails its next wait) rather than after PEER_WAIT_S."""
    local = shared_model("smollm2")
    local.context.clear()
    ids = local.tokenize("Once upon a time, in a land far away,")
    want = list(local.generate(ids, max_tokens=24, temperature=0))
    servers = [start_server() for _ in range(3)]
    with pg.Model("smollm2", n_ctx=256, rpc=[s.endpoint for s in servers], split_mode="tensor", failover=True,
                  progress=False) as m:
        got = []
        with caplog.at_level(logging.WARNING, logger="pyggml.models"):
            for i, token in enumerate(m.generate(ids, max_tokens=24, temperature=0)):
                got.append(token)
                if i == 6:
                    servers[1].kill()
        assert got == want
        assert len(m.model.shards) == 2 and m.lost_endpoints == [servers[1].endpoint]
        said = [r.getMessage() for r in caplog.records if "recovered in" in r.getMessage()]
        assert len(said) == 1 and servers[0].endpoint in said[0] and servers[2].endpoint in said[0]
        # no server waited out a tensor that would never come (PEER_WAIT_S)
        assert "is gone" in said[0] and "within" not in said[0], said[0]


def test_a_batch_of_several_sequences_gives_each_its_solo_logits(rpc_pair):
    """The serving engine's step: sequences side by side in one batch (their products in
    runs, inp_token_runs), each with the logits it gets alone on one device."""
    from pyggml.models.context import Batch
    local = shared_model("smollm2")
    a, b = local.tokenize("The capital of France is"), local.tokenize("Water boils at")
    with pg.Model("smollm2", n_ctx=256, rpc=[s.endpoint for s in rpc_pair], split_mode="tensor",
                  progress=False) as m:
        ctx = m.context
        tokens = np.array(a + b, dtype=np.int32)
        pos = np.array(list(range(len(a))) + list(range(len(b))), dtype=np.int32)
        seq = np.array([0] * len(a) + [1] * len(b), dtype=np.int32)
        out = np.zeros(len(tokens), dtype=bool)
        out[[len(a) - 1, len(tokens) - 1]] = True
        got = ctx.decode_batch(Batch(tokens, pos, seq, out))
        ctx.clear_cache()
    assert np.array_equal(got[0], local.logits(a)[-1]) and np.array_equal(got[1], local.logits(b)[-1])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_biases_and_qk_norms_split_exactly(arch, tmp_path, rpc_pair):
    """qwen2's q/k/v biases are cut with their rows; qwen3's per-head q/k norms go to every
    device.  A synthetic model, so that its 4 query heads over 2 KV heads split on groups."""
    from pyggml.models import Context, load_model
    from pyggml.rpc import connect
    s = Shape()
    path = write_model(tmp_path / f"{arch}.gguf", arch, s, random_weights(arch, s))
    tokens = [3, 17, 42, 99, 5, 64]
    want = Context(load_model(path), n_ctx=64).decode(tokens, all_logits=True)
    devices = connect([x.endpoint for x in rpc_pair]) + [pg.cpu_device()]
    split = load_model(path, "all", devices, split_mode="tensor")
    assert [sh.q_heads for sh in split.shards] == [(0, 2), (2, 4)]
    try:
        assert np.array_equal(Context(split, n_ctx=64).decode(tokens, all_logits=True), want)
    finally:
        split.free()
        for d in devices[:-1]:
            d.conn.close()
    assert np.allclose(want, reference_logits(arch, s, random_weights(arch, s), tokens), atol=2e-2)


def test_each_server_reads_its_rows_from_its_own_file(start_server):
    """--gguf: a server holding the file reads only its own slices of the split weights."""
    path = hub.resolve("smollm2")
    servers = [start_server("--gguf", str(path)) for _ in range(2)]
    ids = shared_model("smollm2").tokenize("The capital of France is")
    with pg.Model(path, n_ctx=128, rpc=[s.endpoint for s in servers], split_mode="tensor", progress=False) as m:
        for dev, mine in zip(m.rpc_devices, m.model.shard_weights):
            conn = dev.conn
            assert conn.loaded["wire"] == 0 and conn.loaded["disk"] == sum(t.nbytes() for t in mine.values())
        # each holds about half of the layers' weights and one holds the embedding too
        assert np.array_equal(m.logits(ids), shared_model("smollm2").logits(ids))


def test_split_mode_auto_divides_layers_only_where_they_are_large(rpc_pair, monkeypatch):
    """-sm auto: SmolLM2's layers (about 2 MiB a share over two servers) are too small to pay
    for their exchanges, so whole layers; with a lower bar, the same servers split every layer,
    with the local logits."""
    from pyggml.models import loader
    ids = prompt_ids("smollm2")
    endpoints = [s.endpoint for s in rpc_pair]
    plans = []
    with pg.Model("smollm2", n_ctx=128, rpc=endpoints, split_mode="auto", progress=False, on_plan=plans.append) as m:
        assert m.model.shards is None and set(m.model.placement.layers) == {0, 1}
    assert "split mode auto: layer" in plans[0] and "is under 8 MiB" in plans[0], plans[0]
    monkeypatch.setattr(loader, "AUTO_TENSOR_SHARE_BYTES", 1 << 20)
    with pg.Model("smollm2", n_ctx=128, rpc=endpoints, split_mode="auto", progress=False, on_plan=plans.append) as m:
        assert len(m.model.shards) == 2
        assert np.array_equal(m.logits(ids), shared_model("smollm2").logits(ids))
    assert "split mode auto: tensor" in plans[1] and "vocab" in plans[1], plans[1]
    # one device, -ngl N: whole layers, and why
    with pg.Model("smollm2", n_ctx=128, rpc=endpoints[:1], split_mode="auto", progress=False,
                  on_plan=plans.append):
        pass
    assert "fewer than two devices" in plans[2]


def test_shares_that_do_not_fit_are_refused_before_any_weight_moves(start_server):
    """Each server's share (its rows, its heads' cache, compute buffers) against its free
    memory: too little is the plan's error, saying how much is missing, not a refused
    allocation halfway through loading."""
    servers = [start_server("--mem", "40M"), start_server("--mem", "40M")]
    with pytest.raises(PlacementError, match=r"does not fit the devices' memory with split mode tensor: .* MiB missing"):
        pg.Model("smollm2", n_ctx=256, rpc=[s.endpoint for s in servers], split_mode="tensor", progress=False)
    from pyggml.rpc import connect
    for s in servers:  # nothing was allocated: the whole budget is still free
        (dev,) = connect(s.endpoint)
        assert dev.get_memory()[0] == 40 << 20
        dev.conn.close()


def test_refusals_are_clear(rpc_pair):
    with pytest.raises(PlacementError, match="needs devices to divide"):
        pg.Model("smollm2", n_ctx=64, split_mode="tensor", progress=False)
    with pytest.raises(PlacementError, match="cannot be combined with -ngl 4"):
        pg.Model("smollm2", n_ctx=64, rpc=rpc_pair[0].endpoint, ngl=4, split_mode="tensor", progress=False)
    with pytest.raises(PlacementError, match="split mode 'diagonal'"):
        pg.Model("smollm2", n_ctx=64, rpc=rpc_pair[0].endpoint, split_mode="diagonal", progress=False)


# -- steps kept on the servers (rpc/steps.py) ------------------------------------------------------

def test_a_decoding_step_is_one_request_per_server(rpc_pair):
    """After two runs of the decode graph each step is the inputs and one STEP_RUN per server:
    no graph, copy or wait request crosses the client's link - and the tokens are those of
    one device."""
    from pyggml.rpc.protocol import Command as C
    local = shared_model("smollm2")
    ids = local.tokenize("The capital of France is")
    with pg.Model("smollm2", n_ctx=256, rpc=[s.endpoint for s in rpc_pair], split_mode="tensor",
                  progress=False) as m:
        ctx = m.context
        conns = [d.conn for d in m.rpc_devices]
        ctx.decode(ids)
        token = int(np.argmax(ctx.decode([int(np.argmax(ctx.decode([ids[-1]])[-1]))])[-1]))  # recorded here
        before = [dict(c.sent) for c in conns]
        got = []
        for _ in range(6):
            got.append(token)
            token = int(np.argmax(ctx.decode([token])[-1]))
        for c, b in zip(conns, before):
            assert c.sent[C.STEP_RUN] - b.get(C.STEP_RUN, 0) == 6
            for cmd in (C.GRAPH_RECOMPUTE, C.GRAPH_COMPUTE, C.COPY_TO_PEER, C.WAIT_PEER):
                assert c.sent[cmd] == b.get(cmd, 0), cmd.name
        # a slot the kept step runs took another graph (as a prompt's graphs may make it): the
        # step is not run, the graphs are, request by request - and the token is still right
        backend, step = next(p.kept for p in ctx.sched._partitions.values() if p.kept)[0]
        backend = ctx.sched.backends[backend]
        backend._slot_generation[next(iter(step.slots))] += 1
        runs = conns[0].sent[C.STEP_RUN]
        got.append(token)
        token = int(np.argmax(ctx.decode([token])[-1]))
        assert conns[0].sent[C.STEP_RUN] == runs and conns[0].sent[C.GRAPH_RECOMPUTE] > before[0][C.GRAPH_RECOMPUTE]
        got.append(token)
        token = int(np.argmax(ctx.decode([token])[-1]))  # ... and that run was recorded anew
        assert conns[0].sent[C.STEP_RUN] == runs + 1
    ref = local.context
    ref.clear()
    ref.decode(ids)
    want = [int(np.argmax(ref.decode([ids[-1]])[-1]))]
    for _ in range(9):
        want.append(int(np.argmax(ref.decode([want[-1]])[-1])))
    ref.clear()
    assert got == want[1:9]


def test_a_kept_step_whose_slot_took_another_graph_is_not_run(rpc_pair, monkeypatch):
    """With few graph slots, prompts and decode steps take each other's slots: the text stays
    one device's.  (Whether a kept step is ever run after its slot changed hands is checked in
    test_a_decoding_step_is_one_request_per_server.)"""
    from pyggml.rpc import protocol as P
    monkeypatch.setattr(P, "GRAPH_SLOTS", 100)  # (the client's side: a decode graph fits, not a prompt's beside it)
    local = shared_model("smollm2")
    prompts = [local.tokenize(t) for t in ("Hello there, my friend", "Two plus two is", "The sky is")]
    with pg.Model("smollm2", n_ctx=256, rpc=[s.endpoint for s in rpc_pair], split_mode="tensor",
                  progress=False) as m:
        for p in prompts * 2:
            assert list(m.generate(p, max_tokens=5, temperature=0)) == \
                list(local.generate(p, max_tokens=5, temperature=0))


def test_step_requests_are_checked_and_bounded(rpc_pair):
    """STEP_STORE holds only graph runs, peer copies and waits, within its limits; STEP_RUN
    names a kept step; a kept step's requests are checked when they run - each failure is the
    session's next reply, and the server serves on."""
    from pyggml.rpc import RPCError, connect
    from pyggml.rpc import protocol as P
    from pyggml.rpc import steps
    from pyggml.rpc.protocol import Command as C
    device = connect(rpc_pair[0].endpoint)[0]
    conn = device.conn
    buffer = device.get_buffer_type().alloc_buffer(4 << 20)  # (a session may send what it holds, and 64 KiB)

    def refusal(cmd: int, payload: bytes, frames: list[bytes] = ()) -> str:
        conn.send(cmd, payload, frames)
        with pytest.raises(RPCError) as e:
            conn.request(C.DEVICE_COUNT)  # the next reply carries what went wrong
        return str(e.value)

    assert "a step may hold only" in refusal(C.STEP_STORE, P.STEP.pack(1), [steps.encode([(C.SET_TENSOR, b"x" * 8)])])
    assert "out of range" in refusal(C.STEP_STORE, P.STEP.pack(P.MAX_STEPS + 1),
                                     [steps.encode([(C.WAIT_PEER, P.U32.pack(1))])])
    assert "whole" in refusal(C.STEP_STORE, P.STEP.pack(1), [P.STEP_ENTRY.pack(C.WAIT_PEER, 400) + b"1234"])
    assert "no step 2" in refusal(C.STEP_RUN, P.STEP.pack(2))
    too_many = steps.encode([(C.WAIT_PEER, P.U32.pack(i)) for i in range(P.MAX_STEP_REQUESTS + 1)])
    assert f"more than {P.MAX_STEP_REQUESTS} requests" in refusal(C.STEP_STORE, P.STEP.pack(4), [too_many])
    # a kept step of a graph slot this session never filled: refused when it runs
    conn.send(C.STEP_STORE, P.STEP.pack(3), [steps.encode([(C.GRAPH_RECOMPUTE, P.RECOMPUTE.pack(0, 5))])])
    assert conn.request(C.DEVICE_COUNT)
    message = refusal(C.STEP_RUN, P.STEP.pack(3))
    assert "GRAPH_RECOMPUTE of a kept step" in message and "no graph in slot 5" in message
    buffer.free()
    conn.close()
    assert len(connect(rpc_pair[0].endpoint)) >= 1  # still serving


def test_a_server_that_makes_no_links_falls_back_to_the_client(start_server, caplog):
    """--no-peers on one server: its slices go through the client, said once; the same bits."""
    import logging
    servers = [start_server("--no-peers"), start_server()]
    local = shared_model("smollm2")
    ids = local.tokenize("The capital of France is")
    with caplog.at_level(logging.WARNING, logger="pyggml.rpc"), \
            pg.Model("smollm2", n_ctx=128, rpc=[s.endpoint for s in servers], split_mode="tensor",
                     progress=False) as m:
        assert np.array_equal(m.logits(ids), local.logits(ids))
        assert list(m.generate(ids, max_tokens=4, temperature=0)) == list(local.generate(ids, max_tokens=4,
                                                                                        temperature=0))
    said = [r.getMessage() for r in caplog.records if "go through this client" in r.getMessage()]
    assert len(said) == 1 and "--no-peers" in said[0], said


def test_tls_servers_split_a_model_between_them(start_server, tmp_path):
    import shutil
    import subprocess
    import sys
    if shutil.which("openssl") is None:
        pytest.skip("making TLS keys needs the openssl command")
    subprocess.run([sys.executable, "-m", "pyggml.cli.rpc_server", "--gen-key", str(tmp_path / "k")],
                   check=True, capture_output=True)
    servers = [start_server("--key", str(tmp_path / "k")) for _ in range(2)]
    local = shared_model("smollm2")
    ids = local.tokenize("The capital of France is")
    with pg.Model("smollm2", n_ctx=128, rpc=[s.endpoint for s in servers], rpc_key=str(tmp_path / "k.client"),
                  split_mode="tensor", progress=False) as m:
        assert np.array_equal(m.logits(ids), local.logits(ids))
