"""flowattn.attention: the fused path, certified bounds, Thm 3.1, masks, equivariance, errors."""

import math

import pytest
import torch

from flowattn.attention import L2MHA, ContractiveL2MHA, DotProductMHA, ScaledCosineMHA
from flowattn.attention.dot_product import merge_heads, split_heads
from flowattn.attention.projections import PROJECTION_LAYOUTS, PROJECTION_ROLES
from flowattn.errors import NonFiniteError
from flowattn.flows import InvertibleResidual, LogDetOptions
from flowattn.lipschitz import jacobian_norm, lipschitz_lower_bound
from flowattn.validation import check_finite

DIM, HEADS = 4, 2


def make(cls, seed=0, **kwargs):
    torch.manual_seed(seed)
    return cls(DIM, HEADS, **kwargs).double()


def one_set_map(module, mask=None, causal=False):
    """The module as a map on one set (n, D) -> (n, D), over its present elements only."""
    if mask is None:
        return lambda x: module(x[None], None, causal)[0]
    present = mask.nonzero().flatten()

    def f(x):
        full = torch.zeros(mask.shape[0], x.shape[1], dtype=x.dtype).index_copy(0, present, x)
        return module(full[None], mask[None], causal)[0, present]

    return f


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ----------------------------------------------------------------------------- fused == reference


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_path_equals_reference_path_outputs_and_gradients(tied, causal, masked):
    module = make(L2MHA, tied=tied)
    x = randn(3, 6, DIM, seed=1) * 2
    mask = None
    if masked:
        mask = torch.ones(3, 6, dtype=torch.bool)
        mask[1, 3:] = False
        mask[2, 1] = False
    weights = randn(3, 6, DIM, seed=2)
    results = []
    for fused in (True, False):
        module.fused = fused
        module.zero_grad()
        xg = x.clone().requires_grad_()
        y = module(xg, mask, causal)
        (y * weights).sum().backward()
        results.append((y, xg.grad, [p.grad.clone() for p in module.parameters()]))
    (y1, gx1, gp1), (y2, gx2, gp2) = results
    assert (y1 - y2).abs().max() <= 1e-10
    assert (gx1 - gx2).abs().max() <= 1e-10
    for a, b in zip(gp1, gp2, strict=True):
        assert (a - b).abs().max() <= 1e-10


@pytest.mark.parametrize("causal,masked", [(False, False), (True, False), (False, True),
                                           (True, True)])
def test_fused_path_is_accurate_in_float32_far_from_the_origin(causal, masked):
    # A large common offset leaves every distance unchanged; the centred fused path must not
    # lose the digits that ||q||^2 - 2 q.k + ||k||^2 would lose in float32. Reached: at most
    # 1.3e-7 over seeds and cases (the rounding of weights and input to float32); without the
    # centring (on the mean key, or on the first key under a causal mask): 1.5e-5 to 2.6e-5.
    module = make(L2MHA)
    x = randn(3, 8, DIM, seed=3) + 1e3
    mask = None
    if masked:
        mask = torch.ones(3, 8, dtype=torch.bool)
        mask[1, 5:] = False
        mask[2, 0] = False
    exact = module(x, mask, causal)  # float64
    module.float()
    y32 = module(x.float(), mask, causal).double()
    rel = (y32 - exact).norm() / exact.norm()
    assert rel < 4e-7, rel.item()  # a margin of 3 over the largest error reached


@pytest.mark.parametrize("offset", [5.0, 50.0])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_path_is_usable_in_bfloat16(offset, causal):
    # Reached: 3.3e-3 to 4.2e-3 over seeds (bfloat16 keeps 8 bits). Without the centring:
    # 4.6e-3 to 5.4e-3 at offset 5 and 2.1e-2 to 2.8e-2 at offset 50, where it matters.
    module = make(L2MHA).bfloat16()
    xb = (randn(3, 16, DIM, seed=4) + offset).bfloat16()
    yb = module(xb, causal=causal).double()
    exact = module.double()(xb.double(), causal=causal)  # float64 on the same bf16 input, weights
    rel = (yb - exact).norm() / exact.norm()
    assert torch.isfinite(yb).all()
    assert rel < 8e-3, rel.item()  # a margin of 2 over the largest error reached


# ----------------------------------------------------------------------------- certified bounds


@pytest.mark.parametrize("p", ["inf", 2])
def test_l2mha_jacobian_norm_never_exceeds_theorem_3_2(p):
    module = make(L2MHA, seed=5)
    n = 5
    bound = module.lipschitz_bound(n, p).item()
    f = one_set_map(module)
    for seed in range(5):
        for scale in (1.0, 100.0):
            x = scale * randn(n, DIM, seed=seed)
            assert jacobian_norm(f, x, p).item() <= bound
    best, _ = lipschitz_lower_bound(f, (n, DIM), p, restarts=3, steps=40)
    assert 0 < best <= bound


@pytest.mark.parametrize("p", ["inf", 2])
@pytest.mark.parametrize("causal", [False, True])
def test_contractive_l2mha_is_certified_below_coeff(p, causal):
    coeff = 0.9
    module = make(ContractiveL2MHA, seed=6, coeff=coeff, norm=p)
    assert module.lipschitz_bound(5).item() == pytest.approx(coeff)
    f = one_set_map(module, causal=causal)
    for seed in range(4):
        for scale in (1.0, 100.0):
            assert jacobian_norm(f, scale * randn(5, DIM, seed=seed), p).item() <= coeff
    best, _ = lipschitz_lower_bound(f, (5, DIM), p, restarts=3, steps=40)
    assert 0 < best <= coeff


@pytest.mark.parametrize("p", ["inf", 2])
def test_contractive_l2mha_stays_below_coeff_on_padded_sets(p):
    module = make(ContractiveL2MHA, seed=7, coeff=0.95, norm=p)
    mask = torch.tensor([True, False, True, True, False, True])
    for causal in (False, True):
        f = one_set_map(module, mask, causal)
        best, _ = lipschitz_lower_bound(f, (4, DIM), p, restarts=2, steps=40)
        assert 0 < best <= 0.95


def test_contractive_bound_in_the_other_norm_is_valid():
    module = make(ContractiveL2MHA, seed=8, norm="inf")
    f = one_set_map(module)
    best, _ = lipschitz_lower_bound(f, (5, DIM), 2, restarts=2, steps=40)
    assert best <= module.lipschitz_bound(5, norm=2).item()


def test_masked_rows_are_normalised_by_their_own_key_count():
    # With the inf-norm each row is divided by the bound for the keys it sees: row 0 of a causal
    # set sees only itself, so f_0 = coeff * F_0 / bound(1).
    module = make(ContractiveL2MHA, seed=9, coeff=0.5)
    x = randn(1, 5, DIM, seed=9)
    raw = module.attention(x, causal=True)
    y = module(x, causal=True)
    for i in range(5):
        expected = 0.5 * raw[0, i] / module.attention.lipschitz_bound(i + 1, "inf")
        torch.testing.assert_close(y[0, i], expected, rtol=1e-12, atol=1e-14)


def test_contractive_denominator_receives_gradients():
    module = make(ContractiveL2MHA, seed=10, coeff=0.9)
    x = randn(1, 4, DIM, seed=10)
    w = module.attention.w_q
    torch.autograd.gradcheck(module, (x.clone().requires_grad_(),), eps=1e-6, atol=1e-7)
    # the weight gradient includes the term through the bound in the denominator
    y = module(x).sum()
    (g,) = torch.autograd.grad(y, w)
    with torch.no_grad():
        delta = torch.zeros_like(w)
        delta[0, 1] = 1e-6
        w.add_(delta)
        up = module(x).sum()
        w.sub_(2 * delta)
        down = module(x).sum()
        w.add_(delta)
    assert math.isclose(g[0, 1].item(), ((up - down) / 2e-6).item(), rel_tol=1e-5, abs_tol=1e-8)


@pytest.mark.parametrize("p", ["inf", 2])
def test_scaled_cosine_jacobian_never_exceeds_theorem_1(p):
    module = make(ScaledCosineMHA, seed=11, eps=1e-2)
    f = one_set_map(module)
    bound = module.lipschitz_bound(4, p).item()
    for seed in range(3):
        for scale in (0.01, 1.0, 100.0):
            assert jacobian_norm(f, scale * randn(4, DIM, seed=seed), p).item() <= bound
    best, _ = lipschitz_lower_bound(f, (4, DIM), p, restarts=2, steps=40)
    assert best <= bound


# ----------------------------------------------------------------------------- Theorem 3.1


def test_dot_product_attention_is_not_lipschitz_but_l2_is():
    # Kim et al. (2021), Thm 3.1: with x_1 = 0 the row P_1 is uniform and d f_1 / d x_1 grows
    # with the variance of the other inputs.
    dp = make(DotProductMHA, seed=12, bias=False)
    l2 = make(L2MHA, seed=12)
    base = randn(6, DIM, seed=12)
    base[0] = 0.0
    dp_norms, l2_norms = [], []
    for spread in (1.0, 10.0, 100.0, 1000.0):
        x = base * spread
        dp_norms.append(jacobian_norm(one_set_map(dp), x, "inf").item())
        l2_norms.append(jacobian_norm(one_set_map(l2), x, "inf").item())
    # grows without bound
    assert all(b > 5 * a for a, b in zip(dp_norms[:-1], dp_norms[1:], strict=True))
    assert dp_norms[-1] > 1e4 * dp_norms[0]
    assert max(l2_norms) <= l2.lipschitz_bound(6, "inf").item()


# ----------------------------------------------------------------------------- sets and masks

ALL_MODULES = [
    (DotProductMHA, {}),
    (L2MHA, {}),
    (L2MHA, {"tied": False}),
    (ContractiveL2MHA, {}),
    (ContractiveL2MHA, {"norm": 2}),
    (ScaledCosineMHA, {}),
]


@pytest.mark.parametrize("cls,kwargs", ALL_MODULES)
def test_permuting_the_set_permutes_the_output(cls, kwargs):
    module = make(cls, seed=13, **kwargs)
    x = randn(2, 7, DIM, seed=13)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(module(x[:, perm]), module(x)[:, perm], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls,kwargs", ALL_MODULES)
@pytest.mark.parametrize("causal", [False, True])
def test_padded_batch_matches_each_set_alone(cls, kwargs, causal):
    module = make(cls, seed=14, **kwargs)
    lengths = [5, 2, 4]
    sets = [randn(n, DIM, seed=20 + n) for n in lengths]
    x = torch.full((3, 5, DIM), 123.0, dtype=torch.float64)  # junk in the padding
    mask = torch.zeros(3, 5, dtype=torch.bool)
    for b, s in enumerate(sets):
        x[b, : len(s)] = s
        mask[b, : len(s)] = True
    y = module(x, mask, causal)
    for b, s in enumerate(sets):
        alone = module(s[None], None, causal)[0]
        torch.testing.assert_close(y[b, : len(s)], alone, rtol=1e-12, atol=1e-12)
        assert (y[b, len(s):] == 0).all()


def test_causal_outputs_do_not_depend_on_the_future():
    module = make(L2MHA, seed=15)
    x = randn(1, 6, DIM, seed=15)
    y = module(x, causal=True)
    x2 = x.clone()
    x2[0, 4:] += 10.0
    assert torch.equal(module(x2, causal=True)[0, :4], y[0, :4])  # exactly, not to rounding


# ----------------------------------------------------------------------------- attention matrices


def _padding(batch, length):
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, 1] = False
    return mask


def _output_from_probabilities(module, x, p):
    """The module's output recomputed as P V W^O from its attention matrices P."""
    if isinstance(module, ContractiveL2MHA):
        raise AssertionError("compare with the probabilities of its L2MHA instead")
    if isinstance(module, DotProductMHA):
        v = split_heads(module.qkv(x).chunk(3, dim=-1)[2], module.heads)
        return module.out(merge_heads(p @ v))
    if isinstance(module, L2MHA):
        if module.tied:
            wq, wv = module.head_weights(module.w_q), module.head_weights(module.w_v)
            a_h = wq @ wq.transpose(1, 2) / math.sqrt(module.head_dim)  # A_h of eq. (8)
            v = x.unsqueeze(1) @ a_h @ wv  # X A_h W^{V,h}
        else:
            v = split_heads(x @ module.w_v, module.heads)
        return merge_heads(p @ v) @ module.w_o
    h = split_heads(x @ module.w_v, module.heads)
    v = h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + module.eps)
    return module.nu * merge_heads(p @ v) @ module.w_o


def _former_lm_probabilities(attn, x, causal):
    """The attention matrices as flowattn.lm.model computed them from the modules' weights
    before the modules gave them themselves (unmasked inputs), kept literally."""
    if isinstance(attn, ContractiveL2MHA):
        attn = attn.attention
    heads = attn.heads
    scale = 1.0 / math.sqrt(attn.head_dim)
    if isinstance(attn, DotProductMHA):
        q, k, _ = (split_heads(t, heads) for t in attn.qkv(x).chunk(3, dim=-1))
        logits = q @ k.transpose(-1, -2) * scale
    elif isinstance(attn, L2MHA):
        q = split_heads(x @ attn.w_q, heads)
        k = q if attn.tied else split_heads(x @ attn.w_k, heads)
        centre = k.mean(dim=2, keepdim=True)
        q, k = q - centre, k - centre
        sq = q.pow(2).sum(-1, keepdim=True) - 2 * q @ k.transpose(-1, -2)
        logits = -(sq + k.pow(2).sum(-1).unsqueeze(-2)) * scale
    else:

        def unit(w):
            h = split_heads(x @ w, heads)
            return h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + attn.eps)

        logits = attn.tau * unit(attn.w_q) @ unit(attn.w_k).transpose(-1, -2)
    if causal:
        n = x.shape[1]
        allowed = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        logits = logits.masked_fill(~allowed, -math.inf)
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("cls,kwargs", ALL_MODULES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_probabilities_are_row_stochastic_over_the_visible_keys(
    cls, kwargs, causal, masked
):
    module = make(cls, seed=17, **kwargs)
    x = randn(3, 6, DIM, seed=17) * 3
    mask = _padding(3, 6) if masked else None
    p = module.attention_probabilities(x, mask, causal)
    assert p.shape == (3, HEADS, 6, 6)
    assert torch.allclose(p.sum(-1), torch.ones(3, HEADS, 6, dtype=torch.float64), atol=1e-12)
    visible = torch.ones(3, 1, 6, 6, dtype=torch.bool)
    if causal:
        visible = visible.tril()
    if masked:
        visible = visible & mask[:, None, None, :]
    visible = visible | torch.eye(6, dtype=torch.bool)  # every element sees itself
    assert (p.masked_select(~visible) == 0).all()
    assert (p.masked_select(visible) > 0).all()


@pytest.mark.parametrize("cls,kwargs", [m for m in ALL_MODULES if m[0] is not ContractiveL2MHA])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_probabilities_are_the_matrices_forward_applies(cls, kwargs, causal, masked):
    module = make(cls, seed=18, **kwargs)
    x = randn(3, 6, DIM, seed=18) * 2
    mask = _padding(3, 6) if masked else None
    p = module.attention_probabilities(x, mask, causal)
    recomputed = _output_from_probabilities(module, x, p)
    if masked:
        recomputed = recomputed * mask.unsqueeze(-1)
    torch.testing.assert_close(recomputed, module(x, mask, causal), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kwargs", [{}, {"norm": 2}])
@pytest.mark.parametrize("causal", [False, True])
def test_contractive_attention_probabilities_are_those_of_its_l2_attention(kwargs, causal):
    module = make(ContractiveL2MHA, seed=19, **kwargs)
    x, mask = randn(3, 5, DIM, seed=19), _padding(3, 5)
    for m in (None, mask):
        expected = module.attention.attention_probabilities(x, m, causal)
        assert torch.equal(module.attention_probabilities(x, m, causal), expected)


@pytest.mark.parametrize("cls,kwargs", ALL_MODULES)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_probabilities_equal_the_former_lm_computation_bit_for_bit(
    cls, kwargs, causal
):
    module = make(cls, seed=20, **kwargs)
    for dtype in (torch.float64, torch.float32):
        module.to(dtype)
        x = (randn(2, 7, DIM, seed=20) * 4 + 1).to(dtype)
        expected = _former_lm_probabilities(module, x, causal)
        assert torch.equal(module.attention_probabilities(x, causal=causal), expected)


def test_attention_probabilities_ignore_attention_dropout_and_check_their_input():
    module = make(L2MHA, seed=21, dropout=0.5).train()
    x = randn(2, 5, DIM, seed=21)
    assert torch.equal(
        module.attention_probabilities(x), module.eval().attention_probabilities(x)
    )
    for cls, kwargs in ALL_MODULES:
        with pytest.raises(ValueError, match="width"):
            make(cls, **kwargs).attention_probabilities(randn(2, 3, DIM + 1))


# ----------------------------------------------------------------------------- projections


ROLES = {
    "DotProductMHA": ["qkv", "output"],
    "L2MHA": ["query", "value", "output"],
    "L2MHA-untied": ["query", "key", "value", "output"],
    "ContractiveL2MHA": ["query", "value", "output"],
    "ScaledCosineMHA": ["query", "key", "value", "output"],
}


@pytest.mark.parametrize("cls,kwargs", ALL_MODULES)
def test_projections_list_every_weight_matrix_once_with_its_role(cls, kwargs):
    module = make(cls, **kwargs)
    projections = module.projections()
    key = cls.__name__ + ("-untied" if kwargs.get("tied") is False else "")
    assert [p.role for p in projections] == ROLES[key]
    for p in projections:
        assert module.get_parameter(p.name) is p.weight
        assert p.role in PROJECTION_ROLES and p.layout in PROJECTION_LAYOUTS
        assert p.fan_in == DIM and p.matrix.shape[1] == DIM
    matrices = {n for n, w in module.named_parameters() if w.dim() == 2}
    assert sorted(p.name for p in projections) == sorted(matrices)


@pytest.mark.parametrize("cls,kwargs", ALL_MODULES)
def test_projection_matrices_are_the_maps_the_module_applies(cls, kwargs):
    module = make(cls, bias=False, **kwargs) if cls is DotProductMHA else make(cls, **kwargs)
    x = randn(5, DIM, seed=22)
    for p in module.projections():
        if p.layout == "linear":
            layer = module.get_submodule(p.name.rsplit(".", 1)[0])
            torch.testing.assert_close(layer(x), x @ p.matrix.t(), rtol=0, atol=1e-14)
        else:  # stored (in, out), applied in the row convention x W
            assert torch.equal(p.matrix, p.weight.t())
    similarity = {DotProductMHA: "dot-product", ScaledCosineMHA: "scaled-cosine"}
    assert module.similarity == similarity.get(cls, "l2")


# ----------------------------------------------------------------------------- dropout rules


def test_contractive_module_refuses_attention_dropout():
    with pytest.raises(ValueError, match="output_dropout"):
        ContractiveL2MHA(DIM, HEADS, dropout=0.1)


def test_output_dropout_keeps_the_certificate_in_training_and_evaluation():
    module = make(ContractiveL2MHA, seed=16, coeff=0.9, output_dropout=0.3)
    x = randn(5, DIM, seed=16)
    module.train()
    for seed in range(5):
        torch.manual_seed(seed)
        state = torch.get_rng_state()

        def f(x, state=state):
            torch.set_rng_state(state)  # the same dropout mask on every Jacobian column
            return module(x[None])[0]

        assert jacobian_norm(f, x, "inf").item() <= 0.9
    module.eval()
    assert jacobian_norm(one_set_map(module), x, "inf").item() <= 0.9 * 0.7 + 1e-12


def test_l2mha_bound_refused_while_attention_dropout_is_active():
    module = make(L2MHA, dropout=0.1)
    with pytest.raises(ValueError, match="dropout"):
        module.lipschitz_bound(4)
    module.eval()
    assert module.lipschitz_bound(4).item() > 0


def test_untied_l2mha_has_no_bound():
    with pytest.raises(ValueError, match="not Lipschitz"):
        make(L2MHA, tied=False).lipschitz_bound(4)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("cls,kwargs", ALL_MODULES)
def test_bad_input_raises_a_value_error_naming_the_problem(cls, kwargs):
    module = make(cls, **kwargs)
    good = randn(2, 3, DIM)
    nan = good.clone()
    nan[0, 1, 2] = float("nan")
    inf = good.clone()
    inf[1, 0, 0] = float("inf")
    cases = [
        (good[0], None, "shape"),
        (randn(2, 3, DIM + 1), None, "width"),
        (nan, None, "non-finite"),
        (inf, None, "non-finite"),
        (good, torch.ones(2, 4, dtype=torch.bool), "mask must have shape"),
        (good, torch.ones(2, 3), "dtype"),
        (good, torch.tensor([[True, True, True], [False, False, False]]), "empty"),
        (good.long(), None, "floating point"),
    ]
    for x, mask, message in cases:
        with pytest.raises(ValueError, match=message):
            module(x, mask)


def test_bad_constructor_arguments_are_rejected():
    with pytest.raises(ValueError, match="divide"):
        L2MHA(6, 4)
    with pytest.raises(ValueError, match="coeff"):
        ContractiveL2MHA(4, 2, coeff=1.0)
    with pytest.raises(ValueError, match="norm"):
        ContractiveL2MHA(4, 2, norm=1)
    with pytest.raises(ValueError, match="dropout"):
        DotProductMHA(4, 2, dropout=1.5)


# ----------------------------------------------------------------------------- extreme scale

SCALE_FREE = [
    (L2MHA, {}),
    (L2MHA, {"tied": False}),
    (ContractiveL2MHA, {}),
    (ContractiveL2MHA, {"norm": 2}),
    (ScaledCosineMHA, {}),
]


def _float32_and_reference(cls, kwargs, x, mask, causal, monkeypatch):
    """Output and gradients in float32, and the same in float64 on the composite kernel."""
    from flowattn.attention import cosine, dot_product, l2
    from flowattn.attention.kernels import composite_attention

    results = []
    for dtype in (torch.float32, torch.float64):
        if dtype == torch.float64:
            for namespace in (cosine, dot_product, l2):
                monkeypatch.setattr(namespace, "attend", composite_attention)
        module = make(cls, seed=23, **kwargs).float().to(dtype)  # the same weights
        xg = x.float().to(dtype).requires_grad_()
        y = module(xg, mask, causal)
        (y * randn(*x.shape, seed=24).to(dtype)).sum().backward()
        results.append([y, xg.grad, *(p.grad for p in module.parameters())])
    return results


@pytest.mark.parametrize("cls,kwargs", SCALE_FREE)
@pytest.mark.parametrize("scale", [1e19, 1e20, 1e30])
@pytest.mark.parametrize("causal,masked", [(False, False), (True, True)])
def test_scale_free_attention_is_correct_at_extreme_scale(
    cls, kwargs, scale, causal, masked, monkeypatch
):
    # float32: squared norms overflow near 1e19 and the logits' true scale is far beyond the
    # range; outputs and gradients must still match float64 (measured: at most 3.6e-7 and
    # 8.8e-7; the tolerances leave a factor of about 5)
    x = randn(3, 6, DIM, seed=23) * scale
    mask = _padding(3, 6) if masked else None
    (y32, *g32), (y64, *g64) = _float32_and_reference(cls, kwargs, x, mask, causal, monkeypatch)
    assert torch.isfinite(y32).all()
    assert (y32.double() - y64).norm() <= 2e-6 * y64.norm()
    for a, b in zip(g32, g64, strict=True):  # (untied W^K's gradient is 0: saturated softmax)
        assert (a.double() - b).norm() <= 5e-6 * b.norm()


@pytest.mark.parametrize("scale", [1e20, 1e30])
def test_l2_attention_matrices_are_correct_at_extreme_scale(scale):
    module = make(L2MHA, seed=25)
    x = randn(2, 5, DIM, seed=25) * scale
    p64 = module.attention_probabilities(x)
    p32 = module.float().attention_probabilities(x.float())
    assert (p32.double() - p64).abs().max() < 1e-6  # saturated: the nearest key (itself) wins


def test_padding_with_huge_values_does_not_reach_present_elements():
    module = make(L2MHA, seed=26).float()
    x = randn(3, 6, DIM, seed=26).float()
    mask = _padding(3, 6)
    junk = torch.where(mask[..., None], x, torch.full_like(x, 1e30))
    for causal in (False, True):
        torch.testing.assert_close(module(junk, mask, causal), module(x, mask, causal),
                                   rtol=1e-6, atol=1e-6)


def test_overflow_raises_a_clear_error_instead_of_returning_nan():
    x = randn(2, 5, DIM, seed=27).float()
    cases = [
        (make(DotProductMHA, seed=27).float(), 1e20, "logits q.k"),  # grows with |x|^2
        (make(L2MHA, seed=27, fused=False).float(), 1e19, r"reference path \(fused=False\)"),
        (make(L2MHA, seed=27).float(), 1e38, "x W"),  # x W itself overflows float32
        (make(ScaledCosineMHA, seed=27).float(), 1e38, "x W"),
    ]
    for module, scale, cause in cases:
        assert torch.isfinite(x * scale).all()
        with pytest.raises(NonFiniteError, match=f"overflowed.*float32.*{cause}"):
            module(x * scale)
        if getattr(module, "fused", True):  # the matrices of L2MHA are always scaled down
            with pytest.raises(NonFiniteError, match="overflowed"):
                module.attention_probabilities(x * scale)


def test_huge_finite_inputs_are_not_reported_as_non_finite():
    for x in (torch.full((2, 3, DIM), 3e38), torch.full((2, 3, DIM), 6e4, dtype=torch.float16)):
        assert not torch.isfinite(x.sum())  # the quick one-reduction test overflows
        check_finite(x)  # accepted: every value is finite
        x[1, 2, 0] = float("nan")
        with pytest.raises(NonFiniteError, match="1 non-finite"):
            check_finite(x)


@pytest.mark.parametrize("logdet", ["exact", "series"])
def test_invertible_contractive_block_is_correct_at_extreme_scale(logdet):
    dtypes, blocks = (torch.float32, torch.float64), []
    for dtype in dtypes:
        torch.manual_seed(28)
        options = LogDetOptions(logdet, generator=torch.Generator().manual_seed(0))
        block = InvertibleResidual(ContractiveL2MHA(DIM, HEADS), logdet=options).to(dtype)
        blocks.append(block.eval())
    for scale in (1e19, 1e30):
        x = randn(2, 5, DIM, seed=28) * scale
        (y32, ld32), (y64, ld64) = (b(x.to(t)) for b, t in zip(blocks, dtypes, strict=True))
        assert torch.isfinite(y32).all() and torch.isfinite(ld32).all()
        assert ((y32.double() - y64).norm() / y64.norm()).item() < 1e-6
        torch.testing.assert_close(ld32.double(), ld64, rtol=1e-4, atol=1e-6)
        x_back = blocks[0].inverse(y32)[0]
        assert ((x_back.double() - x).norm() / x.norm()).item() < 1e-6
