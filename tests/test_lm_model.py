"""Tests for flowattn.lm.model and flowattn.lm.invertible: the Transformer LM, its options, the
LSTM baseline and the inversion of the invertible residual stack."""

import math

import pytest
import torch
import torch.nn.functional as F

import flowattn.validation as validation
from flowattn.attention import L2MHA, ContractiveL2MHA, DotProductMHA, ScaledCosineMHA
from flowattn.errors import InputError, InverseNotConverged, NonFiniteError
from flowattn.lm.config import ATTENTIONS, INITS, LMConfig, LMRunConfig
from flowattn.lm.invertible import invert_hidden_states, reconstruction_report
from flowattn.lm.model import (
    Block,
    CenterNorm,
    ChannelAffine,
    TransformerLM,
    attention_probabilities,
    build_model,
    initialise,
    orthogonality_penalty,
)

V, T = 11, 8


def tiny(**kw) -> LMConfig:
    base = dict(vocab_size=V, block_size=T, layers=2, dim=16, heads=2)
    base.update(kw)
    return LMConfig(**base)


CAUSAL_CASES = [dict(attention=a, norm_position=p) for a in ATTENTIONS for p in ("pre", "post")]
CAUSAL_CASES += [
    dict(invertible=True),
    dict(invertible=True, norm="none", weighted_residual=True),
    dict(norm="centernorm", weighted_residual=True),
    dict(model="lstm"),
]


@pytest.mark.parametrize("kw", CAUSAL_CASES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_logits_at_position_t_ignore_tokens_after_t(kw):
    torch.manual_seed(0)
    model = build_model(tiny(**kw)).double().eval()
    idx = torch.randint(V, (3, T))
    logits, _ = model(idx)
    for t in range(T - 1):
        changed = idx.clone()
        changed[:, t + 1 :] = torch.randint(V, (3, T - t - 1))
        other, _ = model(changed)
        assert torch.allclose(other[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-12)
        assert not torch.allclose(other[:, t + 1 :], logits[:, t + 1 :])


@pytest.mark.parametrize(
    "make",
    [
        lambda: DotProductMHA(16, 4),
        lambda: L2MHA(16, 4, tied=True),
        lambda: L2MHA(16, 4, tied=False),
        lambda: ScaledCosineMHA(16, 4),
    ],
    ids=["dp", "l2-tied", "l2", "scaled-cosine"],
)
def test_attention_probabilities_are_the_matrices_each_module_applies(make):
    torch.manual_seed(0)
    attn = make().double()
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    a = attention_probabilities(attn, x, causal=True)
    assert a.shape == (3, 4, 7, 7)
    assert torch.allclose(a.sum(-1), torch.ones(3, 4, 7, dtype=torch.float64))
    assert (a.triu(1) == 0).all()
    # the module's own matrices (tests/test_attention.py rebuilds forward's output from them)
    assert torch.equal(a, attn.attention_probabilities(x, None, True))


def test_contractive_attention_probabilities_are_those_of_its_l2_attention():
    torch.manual_seed(0)
    f = ContractiveL2MHA(16, 4).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    assert torch.equal(attention_probabilities(f, x), attention_probabilities(f.attention, x))


def test_affinity_penalty_is_sum_over_heads_of_squared_frobenius_distance_to_identity():
    torch.manual_seed(0)
    block = Block(tiny(attention="l2-tied")).double()
    x = torch.randn(3, T, 16, dtype=torch.float64)
    _, penalty = block(x, affinity=True)
    a = attention_probabilities(block.attn, block.norm_attn(x))
    expected = sum(
        (a[b, h].T @ a[b, h] - torch.eye(T, dtype=torch.float64)).pow(2).sum()
        for b in range(3)
        for h in range(2)
    ) / 3
    assert torch.allclose(penalty, expected, rtol=1e-12)


def _orthonormal_columns(rows: int, cols: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(rows, cols, dtype=torch.float64))
    return q


def test_orthogonality_penalty_vanishes_exactly_for_orthogonal_weights():
    torch.manual_seed(0)
    model = TransformerLM(tiny(attention="dp", layers=1)).double()
    block, d = model.blocks[0], 16
    with torch.no_grad():
        stacked = _orthonormal_columns(4 * d, d)  # [W^Q; W^K; W^V; W^O] with P^T P = I
        block.attn.qkv.weight.copy_(stacked[: 3 * d])
        block.attn.out.weight.copy_(stacked[3 * d :])
        block.ff.fc.weight.copy_(_orthonormal_columns(4 * d, d))  # (4D, D): M^T M = I
        block.ff.proj.weight.copy_(_orthonormal_columns(4 * d, d).T)  # (D, 4D): M M^T = I
    assert orthogonality_penalty(model.blocks, 1.0, 1.0).abs() < 1e-24
    with torch.no_grad():
        block.attn.out.weight.mul_(2.0)
    p = torch.cat([block.attn.qkv.weight, block.attn.out.weight])
    expected = (p.T @ p - torch.eye(d, dtype=torch.float64)).pow(2).sum()
    assert expected > 1
    assert torch.allclose(orthogonality_penalty(model.blocks, 0.5, 0.0), 0.5 * expected)


def test_orthogonality_losses_enter_the_training_objective_with_their_lambdas():
    idx = torch.randint(V, (2, T), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    plain = TransformerLM(tiny())
    torch.manual_seed(0)
    regular = TransformerLM(tiny(ortho_attention=1e-2, ortho_ff=1e-3, ortho_affinity=1e-4))
    _, a = plain(idx, idx)
    _, b = regular(idx, idx)
    assert a["reg"] == 0 and b["reg"] > 0
    assert torch.allclose(a["nll"], b["nll"])
    assert torch.allclose(b["loss"], b["nll"] + b["reg"])
    weights = orthogonality_penalty(regular.blocks, 1e-2, 1e-3)
    _, affinity = regular.hidden_states(regular.embed(idx), affinity=True)
    assert weights > 0 and affinity > 0
    assert torch.allclose(b["reg"], weights + 1e-4 * affinity)


class _Wrapped(torch.nn.Module):
    """An attention type the LM has never seen: it only offers the module protocol."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.similarity = inner.similarity

    def forward(self, x, mask=None, causal=False):
        return self.inner(x, mask, causal)

    def attention_probabilities(self, x, mask=None, causal=False):
        return self.inner.attention_probabilities(x, mask, causal)

    def projections(self):
        return self.inner.projections()


@pytest.mark.parametrize("kw", [dict(attention=a) for a in ATTENTIONS] + [dict(invertible=True)],
                         ids=lambda kw: "-".join(map(str, kw.values())))
def test_a_training_step_checks_the_stack_once_not_in_every_layer(kw, host_reads):
    """The blocks trust the stack's own states: no layer checks its input or output (each a
    host synchronisation on a GPU); the stack's result is checked once."""
    torch.manual_seed(0)
    model = build_model(tiny(layers=3, **kw))
    idx = torch.randint(V, (2, T))
    reads = host_reads(lambda: model(idx, idx)[1]["loss"].backward())
    checks = {site: n for site, n in reads.items() if site.startswith("validation.py")}
    assert sum(checks.values()) <= 1, reads  # (none where no layer had a check to defer)


def test_an_overflow_inside_the_stack_is_caught_at_its_end(monkeypatch):
    """A layer inside the stack defers its overflow check, but the stack's result is checked:
    NaN never leaves the model silently."""
    torch.manual_seed(0)
    model = build_model(tiny(attention="dp"))
    forward = DotProductMHA.forward

    def overflowing(self, x, *args, **kwargs):  # an output that overflowed, checked as usual
        return validation.check_output(forward(self, x, *args, **kwargs) * float("inf"), x,
                                       "DotProductMHA")

    monkeypatch.setattr(DotProductMHA, "forward", overflowing)
    idx = torch.randint(V, (2, T))
    with pytest.raises(NonFiniteError, match="TransformerLM overflowed"):
        model(idx, idx)
    assert not validation.inputs_trusted()


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("init", INITS)
def test_a_new_attention_type_needs_no_edit_of_the_lm(attention, init):
    # penalties, affinity and every initialisation scheme read only the module's own methods
    idx = torch.randint(V, (2, T), generator=torch.Generator().manual_seed(1))
    lam = dict(ortho_attention=1e-2, ortho_ff=1e-3, ortho_affinity=1e-4)
    torch.manual_seed(0)
    model = TransformerLM(tiny(attention=attention, init=init, **lam)).double()
    _, expected = model(idx, idx)
    for block in model.blocks:
        block.attn = _Wrapped(block.attn)
    _, losses = model(idx, idx)
    assert torch.equal(losses["loss"], expected["loss"])
    before = [w.clone() for w in model.parameters()]
    torch.manual_seed(3)
    initialise(model, init, 0.25)
    wrapped = [w.clone() for w in model.parameters()]
    for block in model.blocks:
        block.attn = block.attn.inner
    torch.manual_seed(3)
    initialise(model, init, 0.25)
    assert all(torch.equal(a, b) for a, b in zip(wrapped, model.parameters(), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(before, wrapped, strict=True))


def test_glorot_l2_init_draws_l2_weights_from_plus_minus_s_over_sqrt_d():
    torch.manual_seed(0)
    s, d = 0.25, 64
    model = TransformerLM(tiny(attention="l2-tied", init="glorot-l2", init_scale=s, dim=d))
    bound = s / math.sqrt(d)
    for block in model.blocks:
        for w in (block.attn.w_q, block.attn.w_v, block.attn.w_o):
            assert w.abs().max() <= bound
            assert w.abs().max() > 0.95 * bound
        fc = block.ff.fc.weight
        assert fc.abs().max() <= math.sqrt(6 / (fc.shape[0] + fc.shape[1]))
    emb = model.tok_emb.weight
    assert emb.abs().max() <= math.sqrt(6 / (V + d))


def test_lipschitz_init_follows_xu_et_al_bounds():
    torch.manual_seed(0)
    d = 32
    model = TransformerLM(tiny(init="lipschitz", dim=d))
    e_tok, e_pos = math.sqrt(2 / (d + V)), math.sqrt(2 / (d + T))
    assert model.tok_emb.weight.abs().max() <= e_tok
    assert model.pos_emb.weight.abs().max() > 0.9 * e_pos
    for block in model.blocks:
        for lin in (block.attn.qkv, block.attn.out, block.ff.fc, block.ff.proj):
            bound = math.sqrt(1 / lin.in_features)
            assert lin.weight.abs().max() <= bound
            assert lin.weight.abs().max() > 0.9 * bound


@pytest.mark.parametrize("attention", ["dp", "l2-tied", "scaled-cosine"])
def test_spectral_init_makes_every_linear_map_exactly_1_lipschitz(attention):
    torch.manual_seed(0)
    model = TransformerLM(tiny(attention=attention, init="spectral")).double()
    # the linear maps (the logit offsets' table of position biases is not one)
    weights = [p for n, p in model.blocks.named_parameters()
               if p.dim() == 2 and ".offsets." not in n]
    assert len(weights) >= 4 * len(model.blocks)
    for w in weights:
        assert abs(torch.linalg.matrix_norm(w, ord=2).item() - 1.0) < 1e-6


def test_default_init_is_gpt2_with_scaled_residual_projections():
    torch.manual_seed(0)
    layers = 3
    model = TransformerLM(LMConfig(vocab_size=200, block_size=64, layers=layers, dim=128))
    proj = torch.cat([b.ff.proj.weight.flatten() for b in model.blocks])
    fc = torch.cat([b.ff.fc.weight.flatten() for b in model.blocks])
    assert abs(fc.std().item() / 0.02 - 1) < 0.02
    assert abs(proj.std().item() / (0.02 / math.sqrt(2 * layers)) - 1) < 0.02
    assert model.head.weight is not model.tok_emb.weight  # untied by default
    assert abs(model.head.weight.std().item() / 0.02 - 1) < 0.05
    tied = TransformerLM(LMConfig(vocab_size=200, layers=1, dim=16, tie_embeddings=True))
    assert tied.head.weight is tied.tok_emb.weight


def test_weighted_residual_alpha_starts_at_one_over_layers_per_channel():
    model = TransformerLM(tiny(weighted_residual=True, layers=4))
    for block in model.blocks:
        assert block.alpha_attn.shape == (16,)
        assert torch.equal(block.alpha_ff, torch.full((16,), 0.25))


def test_centernorm_centres_and_scales_by_d_over_d_minus_1():
    x = torch.tensor([[1.0, 2.0, 3.0, 10.0]], dtype=torch.float64)
    y = CenterNorm(4).double()(x)
    assert torch.allclose(y, (x - 4.0) * 4 / 3)


def test_channel_affine_is_the_identity_at_start_and_inverts_exactly():
    norm = ChannelAffine(3).double()
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    assert torch.equal(norm(x), x)
    with torch.no_grad():
        norm.shift.copy_(torch.tensor([0.5, -1.0, 2.0]))
        norm.log_scale.copy_(torch.tensor([0.1, -0.3, 0.0]))
    assert torch.allclose(norm(x), (x + norm.shift) * norm.log_scale.exp(), rtol=0, atol=0)
    assert torch.allclose(norm.inverse(norm(x)), x, rtol=0, atol=1e-14)


def test_state_dict_keys_of_attention_and_norms_are_those_of_saved_checkpoints():
    plain = dict(self_offset=0.0, position_bias=0.0)  # the settings before defaults_version 2
    keys = set(TransformerLM(tiny(invertible=True, layers=1, **plain)).state_dict())
    assert {
        "blocks.0.attn.attention.w_q",
        "blocks.0.attn.attention.w_v",
        "blocks.0.attn.attention.w_o",
        "blocks.0.norm_attn.shift",
        "blocks.0.norm_attn.log_scale",
        "blocks.0.norm_ff.shift",
        "blocks.0.norm_ff.log_scale",
    } <= keys
    assert not [k for k in keys if k.startswith("blocks.0.attn.") and "attention.w_" not in k]
    offsets = set(TransformerLM(tiny(invertible=True, layers=1)).state_dict()) - keys
    assert offsets == {"blocks.0.attn.attention.offsets.offset_logit",
                       "blocks.0.attn.attention.offsets.position_logit"}
    keys = set(TransformerLM(tiny(layers=1)).state_dict())
    assert {"blocks.0.attn.qkv.weight", "blocks.0.attn.out.weight"} <= keys


@pytest.mark.parametrize("kw", [{}, dict(weighted_residual=True), dict(norm="none"),
                                dict(contractive_norm="inf"), dict(contractive_norm="2")])
def test_invertible_model_certifies_every_branch_below_its_coefficient(kw):
    torch.manual_seed(0)
    model = TransformerLM(tiny(invertible=True, contractive_coeff=0.8, **kw)).double().eval()
    if kw.get("weighted_residual"):
        with torch.no_grad():  # alpha beyond 1 is clamped inside an invertible block
            for block in model.blocks:
                block.alpha_attn.fill_(5.0)
                block.alpha_ff.fill_(-3.0)
    bounds = [b for pair in model.lipschitz_bounds() for b in pair]
    assert len(bounds) == 4
    assert all(0 < b <= 0.8 + 1e-9 for b in bounds)


@pytest.mark.parametrize("kw", [{}, dict(weighted_residual=True, dropout=0.1), dict(norm="none")])
def test_invertible_stack_reconstructs_embeddings_to_1e_10_in_float64(kw):
    torch.manual_seed(0)
    model = TransformerLM(tiny(invertible=True, **kw)).double()
    with torch.no_grad():  # move the affine norms off the identity so their inverse is exercised
        for norm in (m for b in model.blocks for m in (b.norm_attn, b.norm_ff)):
            if isinstance(norm, ChannelAffine):
                norm.log_scale.uniform_(-0.5, 0.5)
                norm.shift.uniform_(-0.5, 0.5)
    model.eval()
    idx = torch.randint(V, (4, T))
    report = reconstruction_report(model, idx, tol=1e-13, max_iter=1000)
    assert report["max_error"] < 1e-10
    assert report["token_accuracy"] == 1.0


@pytest.mark.parametrize("method", ["fixed-point", "anderson"])
def test_blocks_are_inverted_by_the_flows_residual_solver_in_float32(method, monkeypatch):
    import flowattn.flows.inverse
    import flowattn.lm.invertible as invertible

    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["method"])
        return flowattn.flows.inverse.residual_inverse(*args, **kwargs)

    monkeypatch.setattr(invertible, "residual_inverse", counted)
    torch.manual_seed(0)
    model = TransformerLM(tiny(invertible=True)).eval()
    report = reconstruction_report(model, torch.randint(V, (3, T)), method=method)
    assert calls == [method] * 4  # two residual branches per block
    assert report["max_error"] <= 1e-4 and report["token_accuracy"] == 1.0


def test_an_unknown_inverse_method_is_refused_by_name():
    model = TransformerLM(tiny(invertible=True)).eval()
    with pytest.raises(ValueError, match="method must be one of"):
        invert_hidden_states(model, torch.zeros(1, T, 16), method="newton")


def test_inverse_that_cannot_converge_raises_instead_of_returning_garbage():
    torch.manual_seed(0)
    model = TransformerLM(tiny(invertible=True)).double().eval()
    h, _ = model.hidden_states(model.embed(torch.randint(V, (2, T))))
    with pytest.raises(InverseNotConverged):
        invert_hidden_states(model, h, tol=1e-14, max_iter=1)


def test_inverting_a_non_invertible_model_is_refused():
    model = TransformerLM(tiny()).eval()
    with pytest.raises(ValueError, match="not invertible"):
        invert_hidden_states(model, torch.zeros(1, T, 16))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(invertible=True, norm_position="post"), "post-norm"),
        (dict(invertible=True, attention="dp"), "contractive-l2"),
        (dict(invertible=True, norm="layernorm"), "cannot be inverted"),
        (dict(attention="softmax-free"), "attention: Input should be 'dp'"),
        (dict(heads=3), "must divide"),
        (dict(model="lstm", invertible=True), "LSTM"),
        (dict(init="orthogonal"), "init: Input should be 'default'"),
        (dict(contractive_coeff=1.0), "contractive_coeff"),
    ],
)
def test_invalid_configurations_raise_value_errors_naming_the_problem(kw, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kw)


@pytest.mark.parametrize("kw", [dict(attention=a) for a in ATTENTIONS] + [dict(invertible=True)])
def test_every_parameter_gets_a_gradient_from_the_objective(kw):
    # no unused parameters: DistributedDataParallel needs no find_unused_parameters
    torch.manual_seed(0)
    lam = dict(ortho_attention=1e-3, ortho_ff=1e-3, ortho_affinity=1e-3)
    model = TransformerLM(tiny(weighted_residual=True, **lam, **kw))
    idx = torch.randint(V, (2, T))
    _, losses = model(idx, idx)
    losses["loss"].backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing


def test_sequences_longer_than_the_block_size_are_refused():
    model = TransformerLM(tiny())
    with pytest.raises(ValueError, match="exceeds the block size"):
        model(torch.zeros(1, T + 1, dtype=torch.long))


def test_generation_is_reproducible_and_top_1_is_greedy():
    torch.manual_seed(0)
    model = TransformerLM(tiny()).eval()
    start = torch.zeros(2, 1, dtype=torch.long)
    a = model.generate(start, 12, generator=torch.Generator().manual_seed(3))
    b = model.generate(start, 12, generator=torch.Generator().manual_seed(3))
    assert a.shape == (2, 13) and torch.equal(a, b)
    greedy = model.generate(start, 5, top_k=1)
    x = start
    for _ in range(5):
        logits, _ = model(x)
        x = torch.cat([x, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, x)


@pytest.mark.parametrize("kw", [dict(contractive_norm="inf", self_offset=0.0, position_bias=0.0),
                                dict(weighted_residual=True),
                                dict(contractive_norm="2,inf", self_offset=2.0)],
                         ids=["inf-no-offsets", "default-weighted", "2,inf-offset-2"])
def test_block_lipschitz_bounds_hold_for_and_are_nearly_met_by_the_measured_jacobians(kw):
    # attention branch: inf-norm over a causal sequence of T tokens; feed-forward branch:
    # 2-norm per token. Never exceeded (random and optimised inputs), and the optimiser gets
    # within a factor of each bound, so a bound that forgot a factor (alpha, coeff) fails.
    from flowattn.lipschitz import jacobian_norm, lipschitz_lower_bound

    torch.manual_seed(0)
    model = TransformerLM(tiny(invertible=True, contractive_coeff=0.8, **kw)).double().eval()
    if kw.get("weighted_residual"):
        with torch.no_grad():
            for block in model.blocks:
                block.alpha_attn.fill_(0.5)
                block.alpha_ff.fill_(-0.7)
    dim, norm = model.config.dim, model.config.contractive_norm
    for block, (attn_bound, ff_bound) in zip(model.blocks, model.lipschitz_bounds(T),
                                             strict=True):
        def attn(x, block=block):
            return block.attention_branch(x[None])[0]

        def ff(x, block=block):
            return block.ff_branch(x[None])[0]

        for seed in range(3):
            x = torch.randn(T, dim, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(seed)) * 3
            assert jacobian_norm(attn, x, norm).item() <= attn_bound
            assert jacobian_norm(ff, x[:1], 2).item() <= ff_bound
        best_attn, _ = lipschitz_lower_bound(attn, (T, dim), norm, restarts=3, steps=40)
        best_ff, _ = lipschitz_lower_bound(ff, (1, dim), 2, restarts=3, steps=40)
        assert 0.5 * attn_bound <= best_attn <= attn_bound
        assert 0.3 * ff_bound <= best_ff <= ff_bound


def test_logit_offsets_reach_the_l2_attention_of_the_lm_and_only_it():
    for attention in ("l2", "l2-tied", "contractive-l2"):
        model = TransformerLM(tiny(attention=attention, self_offset=2.0, position_bias=1.0,
                                   max_distance=4))
        attn = model.blocks[0].attn
        offsets = attn.offsets if isinstance(attn, L2MHA) else attn.attention.offsets
        assert (offsets.self_offset, offsets.position_bias, offsets.max_distance) == (2.0, 1.0, 4)
    with pytest.raises(ValueError, match="options of L2 attention"):
        tiny(attention="dp", self_offset=1.0)
    with pytest.raises(ValueError, match="self_offset"):
        tiny(attention="l2-tied", self_offset=-1.0)


# ----------------------------------------------------------------------------- defaults

# The settings every model had before tied L2 attention got defaults of its own, written out.
OLD_SETTINGS = dict(self_offset=0.0, position_bias=0.0, init="default", init_scale=1 / 16,
                    contractive_norm="inf", norm_gain=1.0, readout="linear")


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _seeded(config: LMConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(config)


@pytest.mark.parametrize("kw", [dict(attention="dp"), dict(attention="l2"),
                                dict(attention="scaled-cosine"), dict(attention="none"),
                                dict(model="lstm"), dict(norm_position="post")],
                         ids=["dp", "l2", "scaled-cosine", "none", "lstm", "dp-post"])
def test_defaults_of_every_other_model_build_the_model_of_the_old_explicit_settings(kw):
    new = tiny(**kw)
    assert {k: getattr(new, k) for k in OLD_SETTINGS} == OLD_SETTINGS
    assert _same_state(_seeded(new), _seeded(tiny(**kw, **OLD_SETTINGS)))


@pytest.mark.parametrize("kw, measured", [
    (dict(attention="l2-tied"), dict(self_offset=4.0, position_bias=4.0, init="glorot-l2",
                                     init_scale=0.5, contractive_norm="inf")),
    (dict(attention="contractive-l2"), dict(self_offset=8.0, position_bias=8.0,
                                            init="glorot-l2", init_scale=1 / 8,
                                            contractive_norm="2,inf", norm_gain=4.0)),
    (dict(invertible=True), dict(self_offset=4.0, position_bias=4.0, init="glorot-l2",
                                 init_scale=1.0, contractive_norm="2,inf", norm_gain=1.0,
                                 readout="feed-forward")),
], ids=["l2-tied", "contractive-l2", "invertible"])
def test_tied_l2_attention_defaults_to_its_measured_settings(kw, measured):
    # the rows of docs/benchmarks.md: l2-tied-offsets-glorot-s2, contractive-l2-caps8,
    # invertible-s2
    new = tiny(**kw)
    assert {k: getattr(new, k) for k in measured} == measured
    assert _same_state(_seeded(new), _seeded(tiny(**kw, **measured)))
    assert not _same_state(_seeded(new), _seeded(tiny(**kw, **OLD_SETTINGS)))
    # defaults_version 1 (configs stored before version 2) means the old settings
    old = tiny(**kw, defaults_version=1)
    assert {k: getattr(old, k) for k in OLD_SETTINGS} == OLD_SETTINGS
    assert _same_state(_seeded(old), _seeded(tiny(**kw, **OLD_SETTINGS)))


def test_version_3_certifies_offsets_by_their_weighted_count_and_raises_the_norm_gain():
    new = tiny(attention="contractive-l2")
    torch.manual_seed(0)
    new_model = build_model(new)
    attn = new_model.blocks[0].attn.attention
    assert attn.offset_certificate == "weighted"
    assert all(torch.equal(b.norm_attn.weight, torch.full_like(b.norm_attn.weight, 4.0))
               for b in new_model.blocks)
    # version 2 (configs stored then): the margin form and gain 1, the measured row of then
    v2 = tiny(attention="contractive-l2", defaults_version=2)
    assert (v2.init_scale, v2.norm_gain, v2.self_offset, v2.position_bias) == (0.25, 1.0, 4.0, 4.0)
    # the invertible stack: s = 1/2 under versions 3 and 4, 1/16 as stored under version 2
    assert tiny(invertible=True, defaults_version=4).init_scale == 0.5
    assert tiny(invertible=True, defaults_version=2).init_scale == 1 / 16
    torch.manual_seed(0)
    old_model = build_model(v2)
    assert old_model.blocks[0].attn.attention.offset_certificate == "margin"
    assert all(torch.equal(b.norm_attn.weight, torch.ones_like(b.norm_attn.weight))
               for b in old_model.blocks)
    # the gain is that of the pre-attention LayerNorm: elsewhere auto means 1 and a value is
    # refused
    post = tiny(attention="contractive-l2", norm_position="post")
    # no pre-norm LayerNorm: gain 1, and the scale measured at gain 1 (not the one paired with 4)
    assert (post.norm_gain, post.init_scale) == (1.0, 0.25)
    assert tiny(attention="contractive-l2", norm_position="post", init_scale=0.5).init_scale == 0.5
    assert tiny(invertible=True).norm_gain == 1.0 and tiny(attention="dp").norm_gain == 1.0
    with pytest.raises(ValueError, match="norm_gain=2.0 needs a pre-norm LayerNorm"):
        tiny(attention="dp", norm_position="post", norm_gain=2.0)
    with pytest.raises(ValueError, match="norm_gain=2.0 needs a pre-norm LayerNorm"):
        tiny(invertible=True, norm_gain=2.0)


def test_version_5_reads_the_invertible_stack_through_a_feed_forward_readout():
    # version 5's invertible model: the readout, 8 heads, s = 1 (the measured row
    # invertible-readout-h8-s1-lr6-warmup400); version 4's (stored then): 4 heads, s = 1/2
    new, old = (LMConfig(vocab_size=V, invertible=True, defaults_version=v) for v in (5, 4))
    assert (new.readout, new.heads, new.init_scale) == ("feed-forward", 8, 1.0)
    assert (old.readout, old.heads, old.init_scale) == ("linear", 4, 0.5)
    for attention in ATTENTIONS:  # every other model keeps its linear readout and 4 heads
        other = LMConfig(vocab_size=V, attention=attention)
        assert (other.readout, other.heads) == ("linear", 4)
    assert LMConfig(vocab_size=V, invertible=True, heads=2).heads == 2  # a value wins
    with pytest.raises(ValueError, match="heads=8 must divide dim=12"):
        LMConfig(vocab_size=V, invertible=True, dim=12)
    torch.manual_seed(0)
    new = build_model(tiny(invertible=True)).double().eval()
    old = build_model(tiny(invertible=True, defaults_version=4)).double().eval()
    d, hidden = new.config.dim, new.config.ff_mult * new.config.dim
    assert new.num_parameters() - old.num_parameters() == 2 * d * hidden + d  # FF + LayerNorm
    # the readout sits outside the invertible stack: with the stack's parameters shared, the
    # hidden states and their inverse are the same, the logits are not
    missing, unexpected = new.load_state_dict(old.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith(("readout.", "norm_readout."))
                                              for k in missing)
    idx = torch.randint(V, (3, T))
    e = new.embed(idx)
    h_new, h_old = new.hidden_states(e)[0], old.hidden_states(e)[0]
    assert torch.equal(h_new, h_old)
    assert (invert_hidden_states(new, h_new, tol=1e-12) - e).abs().max() < 1e-9
    z = new.norm_f(h_new)
    expected = new.head(new.norm_readout(z + new.readout.proj(F.gelu(new.readout.fc(z)))))
    assert torch.allclose(new.logits(h_new), expected, atol=1e-12)
    assert (new.logits(h_new) - old.logits(h_old)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="LSTM baseline takes readout 'linear' only"):
        tiny(model="lstm", readout="feed-forward")


@pytest.mark.parametrize("init", INITS)
def test_every_initialisation_scheme_initialises_the_readout_like_the_blocks(init):
    torch.manual_seed(0)
    model = TransformerLM(tiny(attention="dp", readout="feed-forward", init=init, layers=3,
                               dim=64))
    fc, proj = model.readout.fc.weight, model.readout.proj.weight
    if init == "default":  # GPT-2: N(0, 0.02), the residual projection 0.02 / sqrt(2 L)
        assert abs(fc.std().item() / 0.02 - 1) < 0.05
        assert abs(proj.std().item() / (0.02 / math.sqrt(2 * 3)) - 1) < 0.05
    elif init == "spectral":
        for w in (fc, proj):
            assert abs(torch.linalg.matrix_norm(w.double(), ord=2).item() - 1.0) < 1e-5
    else:  # glorot-l2: Glorot uniform; lipschitz: U[-l, l] with l = 1 / sqrt(fan_in)
        for w in (fc, proj):
            fan_in, fan_out = w.shape[1], w.shape[0]
            bound = (math.sqrt(6 / (fan_in + fan_out)) if init == "glorot-l2"
                     else math.sqrt(1 / fan_in))
            assert bound * 0.9 < w.abs().max() <= bound


def test_a_setting_given_explicitly_overrides_its_auto_value():
    config = tiny(attention="l2-tied", self_offset=0.0, init="default")
    assert (config.self_offset, config.position_bias, config.init) == (0.0, 4.0, "default")
    assert tiny(attention="l2", init="glorot-l2").init_scale == 1 / 16
    assert tiny(attention="l2-tied", init_scale="auto").init_scale == 0.5
    with pytest.raises(ValueError, match="options of L2 attention"):
        tiny(attention="dp", self_offset=4.0)


def test_run_settings_keep_auto_and_the_model_settings_resolve_it():
    # "auto" survives in the run's settings, so a flag changing the attention later in the
    # chain (defaults, --config, flags) still gets that attention's defaults
    run = LMRunConfig.build({"attention": "dp"}).updated({"attention": "l2-tied"})
    assert run.network.self_offset == "auto" and run.network.init == "auto"
    model = LMConfig(vocab_size=V, **run.network.to_dict())
    assert (model.self_offset, model.init, model.init_scale) == (4.0, "glorot-l2", 0.5)
    assert "auto" not in model.to_dict().values()
    assert LMConfig.from_dict(model.to_dict()) == model


def test_model_settings_stored_without_defaults_version_rebuild_the_old_model():
    stored = tiny(attention="contractive-l2", **OLD_SETTINGS).to_dict()
    del stored["defaults_version"]
    for key in OLD_SETTINGS:  # also keys that older flowattn did not write at all
        legacy = {k: v for k, v in stored.items() if k != key}
        assert LMConfig.from_dict(legacy) == tiny(attention="contractive-l2",
                                                  defaults_version=1)


@pytest.mark.parametrize("kw", [dict(attention="contractive-l2", self_offset=8.0,
                                     position_bias=8.0),
                                dict(invertible=True)], ids=["contractive-l2", "invertible"])
def test_the_layers_certificates_are_evaluated_together_with_each_layers_own_result(
    kw, monkeypatch, certificate_calls
):
    # the residual stack evaluates its contractive attention's certificates in one batch over
    # the layers: the same loss and derivatives as one evaluation per layer (float64)
    import contextlib

    import flowattn.lm.model as lm_model

    torch.manual_seed(0)
    model = TransformerLM(tiny(layers=3, **kw)).double()
    idx = torch.randint(V, (2, T))
    model(idx)  # ActNorm's data-dependent initialisation, before either run
    # a training-mode forward moves state (the power iterations' vectors): both runs start
    # from this one
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def loss_and_grads():
        model.load_state_dict(state)
        _, losses = model(idx, idx)
        return losses["loss"], torch.autograd.grad(losses["loss"], list(model.parameters()),
                                                   allow_unused=True)

    count = certificate_calls(model)
    shared, shared_grads = loss_and_grads()
    assert count[0] == 1  # one batched evaluation for the three layers
    monkeypatch.setattr(lm_model, "shared_certificates",
                        lambda *args, **kwargs: contextlib.nullcontext())
    own, own_grads = loss_and_grads()
    assert count[0] == 4  # then one per layer
    torch.testing.assert_close(shared, own, rtol=1e-12, atol=0)
    for a, b in zip(shared_grads, own_grads, strict=True):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("settings", [{"attention": "contractive-l2"}, {"invertible": True}],
                         ids=["contractive", "invertible"])
def test_a_2_norm_language_model_is_causal_in_its_length_and_runs_with_offsets(settings):
    # the 2-norm divides a sequence by one bound: it was that of the sequence's own length, so
    # earlier logits changed with the number of characters after them (by up to 3.3 nats), and
    # with offsets and two layers the batched certificate read a value back under vmap
    torch.manual_seed(0)
    config = LMConfig(vocab_size=11, block_size=12, layers=2, dim=16, heads=2,
                      contractive_norm="2", **settings)
    model = build_model(config).double().eval()
    idx = torch.randint(11, (2, 12))
    full = model(idx)[0]
    for length in (1, 4, 11):
        torch.testing.assert_close(model(idx[:, :length])[0], full[:, :length])


@pytest.mark.parametrize("model", ["transformer", "lstm"])
def test_token_ids_and_generation_arguments_are_refused_by_name(model):
    m = build_model(LMConfig(vocab_size=11, block_size=12, layers=1, dim=16, heads=2,
                             model=model))
    ok = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(InputError, match=r"outside \[0, 11\), the vocabulary: \[11\]"):
        m(torch.tensor([[3, 11]]))
    with pytest.raises(InputError, match=r"outside \[0, 11\).*\[-1\]"):
        m(torch.tensor([[3, -1]]))
    with pytest.raises(InputError, match=r"no tokens: shape \(1, 0\)"):
        m(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(InputError, match="targets holds token ids outside"):
        m(ok, torch.full((1, 4), -100))  # every target ignored: a loss of NaN
    with pytest.raises(InputError, match="targets must have idx's shape"):
        m(ok, ok[:, :3])
    with pytest.raises(InputError, match="max_new_tokens must be an integer >= 0, got -3"):
        m.generate(ok, -3)
    with pytest.raises(InputError, match="nothing is left to sample"):
        m.generate(ok, 2, exclude=list(range(11)))
    with pytest.raises(InputError, match=r"exclude holds ids outside \[0, 11\)"):
        m.generate(ok, 2, exclude=[20])
    with pytest.raises(InputError, match="no tokens"):
        m.generate(torch.zeros(1, 0, dtype=torch.long), 5)
    assert m.generate(ok, 0).shape == (1, 4)
    assert not set(m.generate(ok, 20, exclude=[0, 5])[0, 4:].tolist()) & {0, 5}
