"""Closed-form vector-Jacobian products of tied L2 attention (``linearise``), in float64."""

import pytest
import torch

from flowattn import passes
from flowattn.attention import L2MHA, ContractiveL2MHA, l2
from flowattn.errors import InputError

DT = torch.float64


def _inputs(seed, masked, b=3, n=6, d=4):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, d, dtype=DT, generator=gen).requires_grad_(True)
    mask = None
    if masked:
        mask = torch.rand(b, n, generator=gen) < 0.6
        mask[:, 1] = True
    return x, mask


def _autograd_vjps(out, x, w):
    return torch.stack([torch.autograd.grad(out, x, wi, retain_graph=True)[0] for wi in w])


CASES = [
    # (module kwargs, heads, masked, causal)
    ({}, 1, False, False),
    ({}, 2, False, False),
    ({}, 2, True, False),
    ({}, 2, False, True),
    ({}, 4, True, True),
    ({"self_offset": 1.5}, 2, True, False),
    ({"self_offset": 0.5, "position_bias": 1.0}, 2, True, True),
    ({"parametrization": "orthogonal"}, 2, True, False),
    ({"norm": 2}, 2, True, False),
    ({"norm": "2,inf"}, 1, False, True),
    ({"certificate": "thm3.2"}, 2, True, True),
]


def _rows_per_block(monkeypatch, rows, x, heads):
    """Let each block of P's rows hold ``rows`` query rows of one vector (None: all at once,
    P kept)."""
    if rows is not None:
        b, n = x.shape[:2]
        row_bytes = b * heads * n * x.element_size()
        monkeypatch.setattr(passes, "PAIR_BYTES", (n - 1) * row_bytes)  # P not kept
        monkeypatch.setattr(l2, "BLOCK_BYTES", rows * row_bytes)


@pytest.mark.parametrize("rows", [None, 2, 4])  # all rows; blocks of 2; blocks of 4 and 2
@pytest.mark.parametrize("kwargs, heads, masked, causal", CASES)
def test_contractive_linearise_gives_forward_and_the_autograd_vjp(
    monkeypatch, kwargs, heads, masked, causal, rows
):
    torch.manual_seed(heads)
    f = ContractiveL2MHA(4, heads, coeff=0.9, **kwargs).double()
    if "self_offset" in kwargs or "position_bias" in kwargs:
        with torch.no_grad():  # offsets away from their initial values
            for p in f.attention.offsets.parameters():
                p.add_(torch.randn_like(p))
    x, mask = _inputs(heads + 10 * masked + 20 * causal, masked)
    _rows_per_block(monkeypatch, rows, x, heads)
    out, vjp = f.linearise(x, mask, causal)
    ref = f(x, mask, causal)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-14)
    w = torch.randn(2, *x.shape, dtype=DT)  # a leading batch of vectors
    auto = _autograd_vjps(ref, x, w)
    assert torch.allclose(vjp(w), auto, rtol=1e-11, atol=1e-13)
    assert torch.allclose(vjp(w[0]), auto[0], rtol=1e-11, atol=1e-13)  # no leading dimension
    assert torch.allclose(vjp(w[:1]), auto[:1], rtol=1e-11, atol=1e-13)  # a stack of one
    grid = torch.randn(2, 3, *x.shape, dtype=DT)  # two leading dimensions
    auto = _autograd_vjps(ref, x, grid.flatten(0, 1)).unflatten(0, (2, 3))
    assert torch.allclose(vjp(grid), auto, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("masked, causal", [(False, False), (True, True)])
def test_blocks_of_rows_give_the_products_and_derivatives_of_one_block(monkeypatch, masked,
                                                                      causal):
    # the Neumann gradient differentiates the products again: w.r.t. x, w and the weights
    torch.manual_seed(5)
    f = ContractiveL2MHA(4, 2, coeff=0.9, self_offset=1.0, position_bias=1.0).double()
    x, mask = _inputs(7, masked, n=7)
    w = torch.randn(3, *x.shape, dtype=DT, requires_grad=True)
    u = torch.randn(3, *x.shape, dtype=DT)

    def run():
        out, vjp = f.linearise(x, mask, causal)
        loss = (out * u[0]).sum() + (vjp(w) * u).sum()
        inputs = [x, w, *f.parameters()]
        grads = torch.autograd.grad(loss, inputs, create_graph=True)
        # and once more: a third derivative of the attention
        (again,) = torch.autograd.grad((grads[0] * u[1]).sum(), x)
        return out, [g.detach() for g in grads] + [again]

    def graph_free():  # evaluation: P's blocks kept once, split further for three vectors
        with torch.no_grad():
            out, vjp = f.linearise(x, mask, causal)
            return out, vjp(w), vjp(w[0]), vjp(w)

    whole, whole_grads = run()
    whole_free = graph_free()
    for rows in (1, 3, 6):  # blocks of 1; of 3, 3 and 1; of 6 and 1 (pieces of 2 for 3 vectors)
        _rows_per_block(monkeypatch, rows, x, 2)
        out, grads = run()
        torch.testing.assert_close(out, whole, rtol=1e-12, atol=1e-14)
        for got, want in zip(grads, whole_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-13)
        for got, want in zip(graph_free(), whole_free, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    # P kept whole, but a stack of three vectors too large for one pass: P's rows in pieces
    row_bytes = 3 * 2 * 7 * 8  # B H N, float64
    monkeypatch.setattr(passes, "PAIR_BYTES", 7 * row_bytes)
    monkeypatch.setattr(l2, "BLOCK_BYTES", 3 * row_bytes)  # one row of three vectors a piece
    out, grads = run()
    for got, want in zip([out, *grads], [whole, *whole_grads], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-13)
    for got, want in zip(graph_free(), whole_free, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_blocks_of_rows_only_where_p_outgrows_a_pass(monkeypatch):
    # small sets take all rows in one block: the code of one block, no slicing
    f = ContractiveL2MHA(4, 2).double()
    x, _ = _inputs(1, False, n=8)
    calls = []
    original = l2.L2MHA._probability_rows

    def spy(self, q, k, r, mask, causal, rows=None, *parts):
        calls.append(rows)
        return original(self, q, k, r, mask, causal, rows, *parts)

    monkeypatch.setattr(l2.L2MHA, "_probability_rows", spy)
    f.linearise(x)
    assert calls == [None]
    calls.clear()
    row_bytes = 3 * 2 * 8 * 8  # B H N, float64
    monkeypatch.setattr(passes, "PAIR_BYTES", 8 * row_bytes)  # P just within a pass: kept
    monkeypatch.setattr(l2, "BLOCK_BYTES", row_bytes)
    with torch.no_grad():
        _, vjp = f.linearise(x)
        pieces = []  # a stack of three vectors: dP three times P, so P's rows one at a time
        products = l2._row_block_products
        monkeypatch.setattr(l2, "_row_block_products",
                            lambda p, *a: pieces.append(p.shape[-2]) or products(p, *a))
        vjp(torch.stack([x, x, x]))
        monkeypatch.setattr(l2, "_row_block_products", products)
    assert calls == [None] and pieces == [1] * 8
    calls.clear()
    _rows_per_block(monkeypatch, 3, x, 2)
    blocks = [slice(0, 3), slice(3, 6), slice(6, 9)]
    f.linearise(x)
    assert calls == blocks
    calls.clear()
    with torch.no_grad():  # graph-free: the blocks once, kept for every product
        _, vjp = f.linearise(x)
        vjp(x), vjp(x)
    assert calls == blocks
    calls.clear()
    rows = []  # and a stack of three vectors takes them a row at a time (dP three times larger)
    products = l2._row_block_products
    monkeypatch.setattr(l2, "_row_block_products",
                        lambda p, *a: rows.append(p.shape[-2]) or products(p, *a))
    with torch.no_grad():
        vjp(torch.stack([x, x, x]))
    assert rows == [1] * 8
    _, vjp = f.linearise(x)  # recorded: every product computes its blocks again
    vjp(x)
    assert calls == blocks * 2


@pytest.mark.parametrize("masked, causal", [(False, False), (True, True)])
def test_l2mha_linearise_gives_the_autograd_vjp_of_both_paths(masked, causal):
    torch.manual_seed(3)
    x, mask = _inputs(4, masked)
    for fused in (True, False):
        attn = L2MHA(4, 2, fused=fused).double()
        with torch.no_grad():
            attn.w_q.mul_(2.0)  # sharper attention: larger logit terms in the Jacobian
        out, vjp = attn.linearise(x, mask, causal)
        ref = attn(x, mask, causal)
        assert torch.allclose(out, ref, rtol=1e-12, atol=1e-14)
        w = torch.randn(*x.shape, dtype=DT)
        (auto,) = torch.autograd.grad(ref, x, w)
        assert torch.allclose(vjp(w), auto, rtol=1e-11, atol=1e-13)


def test_linearise_with_training_output_dropout_is_the_vjp_of_its_own_output():
    torch.manual_seed(5)
    f = ContractiveL2MHA(4, 2, coeff=0.9, output_dropout=0.3).double().train()
    x, mask = _inputs(6, True)
    out, vjp = f.linearise(x, mask)
    assert (out == 0).any()  # some outputs dropped
    w = torch.randn(*x.shape, dtype=DT)
    (auto,) = torch.autograd.grad(out, x, w)
    assert torch.allclose(vjp(w), auto, rtol=1e-11, atol=1e-13)
    f.eval()  # classic dropout at evaluation: the factor 1 - p
    out, vjp = f.linearise(x, mask)
    ref = f(x, mask)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-14)
    (auto,) = torch.autograd.grad(ref, x, w)
    assert torch.allclose(vjp(w), auto, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("masked, causal", [(False, False), (True, False), (True, True)])
def test_linearise_product_is_differentiable_like_a_double_backward(masked, causal):
    """d/d(x, theta) of u^T J v from the closed form equals autograd's double backward: the
    Neumann gradient of a log-det needs exactly this."""
    torch.manual_seed(7)
    f = ContractiveL2MHA(4, 2, coeff=0.9, self_offset=1.0).double()
    x, mask = _inputs(8, masked)
    u, v = torch.randn(2, *x.shape, dtype=DT)
    wrt = [x, *f.parameters()]
    _, vjp = f.linearise(x, mask, causal)
    mine = torch.autograd.grad((vjp(u) * v).sum(), wrt, allow_unused=True)
    (first,) = torch.autograd.grad(f(x, mask, causal), x, u, create_graph=True)
    double = torch.autograd.grad((first * v).sum(), wrt, allow_unused=True)
    for a, b, t in zip(mine, double, wrt, strict=True):
        a = torch.zeros_like(t) if a is None else a
        b = torch.zeros_like(t) if b is None else b
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("masked, causal", [(False, False), (True, True)])
def test_a_stack_of_products_is_differentiable_like_each_product(masked, causal):
    """The exact log-det differentiates its whole stack of N D products at once: the
    derivative of sum_s u_s^T J v_s equals the sum of each product's double backward."""
    torch.manual_seed(9)
    f = ContractiveL2MHA(4, 2, coeff=0.9, self_offset=1.0).double()
    x, mask = _inputs(10, masked)
    u, v = torch.randn(2, 5, *x.shape, dtype=DT)
    wrt = [x, *f.parameters()]
    _, vjp = f.linearise(x, mask, causal)
    stacked = torch.autograd.grad((vjp(u) * v).sum(), wrt, allow_unused=True)
    each = [torch.zeros_like(t) for t in wrt]
    for us, vs in zip(u, v, strict=True):
        (first,) = torch.autograd.grad(f(x, mask, causal), x, us, create_graph=True)
        grads = torch.autograd.grad((first * vs).sum(), wrt, allow_unused=True)
        each = [e if g is None else e + g for e, g in zip(each, grads, strict=True)]
    for a, b, t in zip(stacked, each, wrt, strict=True):
        a = torch.zeros_like(t) if a is None else a
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("stack", [(), (1,), (5,), (2, 3)])
def test_stacked_products_are_each_matrix_of_the_stack_times_the_shared_one(stack):
    """``_each_times`` (w_s @ a) and ``_times_each`` (a @ w_s), a stack w_s against a matrix
    shared by all of it, moved into one product's rows or columns, equal matmul's
    broadcasting: values and derivatives, wide and narrow shapes."""
    gen = torch.Generator().manual_seed(len(stack))
    batch = (2, 3)
    for m, k, n in ((4, 3, 5), (6, 1, 2), (2, 6, 6), (7, 2, 1)):
        for helper, w_shape, a_shape in ((l2._each_times, (m, k), (k, n)),
                                         (l2._times_each, (k, n), (m, k))):
            w = torch.randn(*stack, *batch, *w_shape, dtype=DT, generator=gen).requires_grad_()
            a = torch.randn(*batch, *a_shape, dtype=DT, generator=gen).requires_grad_()
            out = helper(w, a) if helper is l2._each_times else helper(a, w)
            ref = w @ a if helper is l2._each_times else a @ w
            assert out.shape == ref.shape
            assert torch.allclose(out, ref, rtol=1e-13, atol=1e-14)
            g = torch.randn(ref.shape, dtype=DT, generator=gen)
            for mine, auto in zip(torch.autograd.grad(out, (w, a), g),
                                  torch.autograd.grad(ref, (w, a), g), strict=True):
                assert torch.allclose(mine, auto, rtol=1e-13, atol=1e-14)


def test_linearise_on_down_scaled_huge_inputs_matches_autograd_in_float32():
    """Inputs whose squared distances would overflow float32 take the down-scaled logits
    (factor r / s in the product); the product still equals autograd's."""
    torch.manual_seed(9)
    f = ContractiveL2MHA(4, 2, coeff=0.9)
    gen = torch.Generator().manual_seed(10)
    x = (torch.randn(2, 5, 4, generator=gen) * torch.tensor([1e-9, 1e19]).view(2, 1, 1))
    x.requires_grad_(True)
    out, vjp = f.linearise(x)
    ref = f(x)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-6 * float(ref.detach().abs().max()))
    w = torch.randn(2, 5, 4, generator=gen)
    (auto,) = torch.autograd.grad(ref, x, w)
    mine = vjp(w)
    assert torch.isfinite(mine).all()
    assert torch.allclose(mine, auto, rtol=1e-3, atol=1e-5 * float(auto.abs().max()))


def test_linearise_refuses_untied_attention_and_attention_dropout():
    x = torch.randn(2, 3, 4)
    with pytest.raises(InputError, match="tied"):
        L2MHA(4, 2, tied=False).linearise(x)
    with pytest.raises(InputError, match="dropout"):
        L2MHA(4, 2, dropout=0.1).train().linearise(x)
    with pytest.raises(InputError, match="width"):
        ContractiveL2MHA(4, 2).linearise(torch.randn(2, 3, 5))


def test_linearise_carries_the_logit_factor_of_down_scaled_queries(monkeypatch):
    """With the overflow limit lowered, ordinary inputs take the down-scaled path (queries
    divided by s, logits multiplied by r = min(s^2, cap)) while the softmax stays soft: the
    factor r / s of the product is then visible, and must match autograd's."""
    import flowattn.attention.l2 as l2

    monkeypatch.setattr(l2, "square_safe_limit", lambda *args, **kwargs: 0.125)
    torch.manual_seed(11)
    f = ContractiveL2MHA(8, 2, coeff=0.9).double()
    x, mask = _inputs(12, True, d=8)
    out, vjp = f.linearise(x, mask)
    ref = f(x, mask)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-14)
    p = f.attention_probabilities(x, mask)
    assert float(p.detach().max()) < 0.99  # not saturated: the logit term of the Jacobian counts
    w = torch.randn(*x.shape, dtype=DT)
    (auto,) = torch.autograd.grad(ref, x, w)
    assert torch.allclose(vjp(w), auto, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("norm", ["inf", 2, "2,inf"])
@pytest.mark.parametrize("masked, causal", [(False, False), (True, False), (False, True),
                                            (True, True)])
def test_contractive_divides_each_row_by_the_bound_for_its_own_number_of_keys(norm, masked,
                                                                               causal):
    """The bound is looked up in a table over the counts 1..N: it must be the bound of each
    row's own count (each set's present count in the 2-norm)."""
    torch.manual_seed(13)
    f = ContractiveL2MHA(4, 2, coeff=0.9, norm=norm).double()
    x, mask = _inputs(14, masked, n=7)
    present = torch.ones(3, 7, dtype=torch.bool) if mask is None else mask
    if f.norm == "2":
        counts = present.sum(1, keepdim=True).expand(3, 7)
    elif causal:
        counts = torch.where(present, present.long().cumsum(1), 1)
    else:
        counts = torch.where(present, present.sum(1, keepdim=True), 1)
    # full calls (not causal) may take the bound of full attention, smaller in the 2-norm
    bound = torch.stack([f.attention.lipschitz_bound(int(k), f.norm, causal=causal)
                         for k in counts.flatten()])
    expected = 0.9 * f.attention(x, mask, causal) / bound.reshape(3, 7, 1)
    assert torch.allclose(f(x, mask, causal), expected, rtol=1e-13, atol=1e-15)


def test_linearise_raises_on_overflow_like_the_forward_pass():
    """x W overflowing float32: NonFiniteError, as from the forward pass, never NaN."""
    from flowattn.errors import NonFiniteError

    torch.manual_seed(15)
    f = ContractiveL2MHA(4, 2, coeff=0.9)
    with torch.no_grad():
        f.attention.w_q.mul_(10.0)
    gen = torch.Generator().manual_seed(16)
    x = (torch.rand(2, 5, 4, generator=gen) * 2 - 1) * 1e38
    for call in (f, f.linearise):
        with pytest.raises(NonFiniteError, match="overflowed"):
            call(x)
    out, vjp = f.linearise(x * 1e-8)  # 1e30: down-scaled, finite, the forward's values
    assert torch.isfinite(out).all()
    assert torch.allclose(out, f(x * 1e-8), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_masks_and_offsets_of_some_rows_are_those_rows_of_the_whole(causal):
    # a block of rows builds its own (rows, N) mask and offsets, not the whole (N, N) ones
    from flowattn.attention.masking import attention_mask

    mask = torch.rand(2, 7, generator=torch.Generator().manual_seed(0)) < 0.6
    rows = slice(2, 5)
    whole = attention_mask(mask, causal, 7, "cpu")
    assert torch.equal(attention_mask(mask, causal, 7, "cpu", rows), whole[..., rows, :])
    f = L2MHA(4, 2, self_offset=1.0, position_bias=1.0, max_distance=3).double()
    with torch.no_grad():
        for p in f.offsets.parameters():
            p.add_(torch.randn_like(p))
    whole = f.offsets(7)
    assert torch.equal(f.offsets(7, rows=rows), whole[..., rows, :])


def test_recorded_blocks_keep_no_operation_of_a_block_in_the_graph(monkeypatch):
    # each recorded block is one node whose backward computes it again: none of its
    # operations (the softmax of its logits, the products with P) is recorded in the forward
    torch.manual_seed(3)
    f = ContractiveL2MHA(4, 2, coeff=0.9, self_offset=1.0).double()
    x, _ = _inputs(2, False, n=7)
    _rows_per_block(monkeypatch, 3, x, 2)  # blocks of 3, 3 and 1 rows
    out, vjp = f.linearise(x)
    product = vjp(torch.randn_like(x))
    for y in (out, product):
        names, seen, stack = [], set(), [y.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            names.append(node.name())
            stack.extend(next_node for next_node, _ in node.next_functions)
        assert not any("Softmax" in name for name in names)
        assert sum("Recomputed" in name for name in names) == 3


def test_recomputed_derivatives_are_those_of_the_call_to_every_order():
    # arguments computed from one another (a transpose, a slice), a non-tensor argument:
    # the derivatives w.r.t. each are those of the call alone, to the third order
    gen = torch.Generator().manual_seed(0)
    a0 = torch.randn(4, 3, dtype=DT, generator=gen, requires_grad=True)
    c0 = torch.randn(5, dtype=DT, generator=gen, requires_grad=True)

    def function(a, b, c, rows):
        return (a[rows] * c.sum()).tanh() @ b, (b * c[1:4].prod()).exp()

    def derivatives(call):
        a, c = a0 * 1.5, c0.sin()
        out = call(function, a, a.t()[:, 1:], c[1:], slice(1, 3))
        loss = out[0].pow(2).sum() + out[1].sum()
        first = torch.autograd.grad(loss, [a0, c0], create_graph=True)
        second = torch.autograd.grad(first[0].pow(2).sum() + first[1].sum(), [a0, c0],
                                     create_graph=True)
        third = torch.autograd.grad(second[0].sum() * second[1].sum(), [a0, c0])
        return [*first, *second, *third]

    for got, want in zip(derivatives(l2._Recomputed.apply),
                         derivatives(lambda fn, *args: fn(*args)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_recomputed_blocks_recompute_under_the_forward_autocast(monkeypatch):
    # the backward computes a block again in the precision its forward ran in (bfloat16 under
    # CPU autocast, entered again around the recomputation), as the forward pass did
    torch.manual_seed(4)
    f = ContractiveL2MHA(4, 2, coeff=0.9)
    x = torch.randn(3, 7, 4, requires_grad=True)
    _rows_per_block(monkeypatch, 3, x, 2)
    states = []
    original = l2.L2MHA._probability_rows

    def spy(self, *args):
        states.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        return original(self, *args)

    monkeypatch.setattr(l2.L2MHA, "_probability_rows", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, vjp = f.linearise(x)
        loss = out.float().sum() + vjp(torch.ones_like(x)).float().sum()
    forward = len(states)
    loss.backward()
    assert forward == 6 and len(states) == 12  # three blocks for the output and the product
    assert states[:forward] == [(False, True)] * 6  # no graph recorded in the forward pass
    assert states[forward:] == [(True, True)] * 6  # with a graph, under the same autocast
