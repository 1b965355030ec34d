"""torch.compile of residual flows, attention modules and CNF fields: the compiled module gives the
eager outputs and gradients."""

import copy

import pytest
import torch

from flowattn.attention import (
    L2MHA,
    ContractiveL2MHA,
    ContractiveScaledCosineMHA,
    DotProductMHA,
    ScaledCosineMHA,
)
from flowattn.branches import LipschitzMLP
from flowattn.flows import InvertibleResidual, LogDetOptions, set_flow
from flowattn.flows.continuous import AttentionField, DotProductField, EGNNField
from flowattn.training.device import NO_COMPILER, cpp_compiler

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),  # in torch
    pytest.mark.skipif(cpp_compiler() is None, reason=NO_COMPILER),
]

DT = torch.float64


@pytest.fixture(autouse=True)
def fresh_compiler_caches():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _roulette():
    return LogDetOptions("roulette", grad="neumann", n_exact_terms=1,
                         generator=torch.Generator().manual_seed(4))


def _assert_same(a, b, rtol=1e-10, atol=1e-12):
    assert torch.allclose(a, b, rtol=rtol, atol=atol), (a - b).abs().max()


def test_compiled_mlp_block_gives_the_eager_outputs_and_gradients():
    torch.manual_seed(0)
    eager = InvertibleResidual(LipschitzMLP(2, [16, 16], coeff=0.9), logdet=_roulette()).double()
    twin = copy.deepcopy(eager)
    twin.logdet_options = _roulette()  # the same seed: the same probes and roulette lengths
    compiled = torch.compile(twin)
    for _ in range(3):  # roulette lengths vary from step to step: no recompiled loop
        x = torch.randn(8, 3, 2, dtype=DT, requires_grad=True)
        outputs = []
        for block, module in ((eager, eager), (compiled, twin)):
            y, logdet = block(x)
            loss = (y**2).sum() - logdet.sum()
            grads = torch.autograd.grad(loss, [x, *module.parameters()])
            outputs.append((y, logdet, *grads))
        for a, b in zip(*outputs, strict=True):
            _assert_same(a, b)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # really compiled


def test_compiled_set_flow_training_step_gives_the_eager_log_prob_and_gradients():
    """Attention blocks keep their autograd log-det (a double backward) out of the compiled
    graphs; everything around them compiles."""
    torch.manual_seed(1)
    x = torch.randn(6, 5, 2, dtype=DT)
    eager = set_flow(dim=2, blocks=2, heads=1).double()
    eager.log_prob(x)  # ActNorm's data-dependent initialisation, once
    twin = copy.deepcopy(eager)
    for flow in (eager, twin):
        for block in flow.modules():
            if isinstance(block, InvertibleResidual):
                block.logdet_options = _roulette()
    compiled = torch.compile(twin.log_prob)
    for _ in range(2):
        results = []
        for log_prob, flow in ((eager.log_prob, eager), (compiled, twin)):
            value = log_prob(x)
            grads = torch.autograd.grad(value.mean(), list(flow.parameters()), allow_unused=True)
            results.append((value, grads))
        (v1, g1), (v2, g2) = results
        _assert_same(v1, v2)
        for a, b in zip(g1, g2, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                _assert_same(a, b)


def test_compiled_block_refuses_bad_input_like_the_eager_one():
    block = torch.compile(InvertibleResidual(LipschitzMLP(2, 8), logdet=_roulette()))
    with pytest.raises(ValueError, match="non-finite"):
        block(torch.tensor([[[float("nan"), 0.0]]]))


ATTENTION = {
    "dp": lambda: DotProductMHA(8, 2),
    "l2-tied": lambda: L2MHA(8, 2),
    "l2-untied": lambda: L2MHA(8, 2, tied=False),
    "l2-tied-offsets": lambda: L2MHA(8, 2, self_offset=3.0, position_bias=2.0),
    "contractive-l2": lambda: ContractiveL2MHA(8, 2),
    "contractive-l2-mixed": lambda: ContractiveL2MHA(8, 2, norm="2,inf"),
    "scaled-cosine": lambda: ScaledCosineMHA(8, 2),
    "contractive-scaled-cosine": lambda: ContractiveScaledCosineMHA(8, 2),
}


def _outputs_and_gradients(module, call, x, *args):
    y = call(x, *args)
    grads = torch.autograd.grad((y * torch.cos(y)).sum(), [x, *module.parameters()],
                                allow_unused=True)
    return y, grads


def _assert_same_results(eager, compiled):
    (y1, g1), (y2, g2) = eager, compiled
    _assert_same(y1, y2)
    for a, b in zip(g1, g2, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            _assert_same(a, b)


# Every module is traced by dynamo and AOT autograd (``aot_eager``: the graphs inductor would
# receive, run eagerly, seconds per module); the residual-flow branch and one CNF field also go
# through inductor's C++ code generation (tens of seconds each on CPU).
INDUCTOR = {"contractive-l2", "attention"}


def _backend(name):
    return "inductor" if name in INDUCTOR else "aot_eager"


@pytest.mark.parametrize("name", list(ATTENTION))
def test_compiled_attention_gives_the_eager_outputs_and_gradients(name):
    torch.manual_seed(2)
    module = ATTENTION[name]().double()
    compiled = torch.compile(module, backend=_backend(name))
    cases = ((5, False), (7, True)) if name in INDUCTOR else ((7, True),)
    for n, causal in cases:  # a second size: recompiled, never a stale graph
        x = torch.randn(3, n, 8, dtype=DT, requires_grad=True)
        mask = torch.ones(3, n, dtype=torch.bool)
        mask[0, -2:] = False
        eager = _outputs_and_gradients(module, module, x, mask, causal)
        fast = _outputs_and_gradients(module, compiled, x, mask, causal)
        _assert_same_results(eager, fast)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # really compiled


FIELDS = {
    "attention": lambda: AttentionField(dim=3, heads=2, layers=2, hidden=8),
    "dot-product": lambda: DotProductField(dim=3, heads=2, layers=2, hidden=8),
    "egnn": lambda: EGNNField(dim=3, hidden=8, layers=2),
}


@pytest.mark.parametrize("name", list(FIELDS))
def test_compiled_cnf_field_gives_the_eager_outputs_and_gradients(name):
    torch.manual_seed(3)
    field = FIELDS[name]().double()
    compiled = torch.compile(field, backend=_backend(name))
    t = torch.tensor(0.3, dtype=DT)
    x = torch.randn(4, 6, 3, dtype=DT, requires_grad=True)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, -1] = False
    eager = _outputs_and_gradients(field, lambda z: field(t, z, mask), x)
    fast = _outputs_and_gradients(field, lambda z: compiled(t, z, mask), x)
    _assert_same_results(eager, fast)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


def _particle_flow():
    """The DW4 default flow (monotone radial and many-body residual blocks with closed-form
    Jacobians), two blocks of each kind, in float64 and initialised; then rebuilt from its
    state dict, as a resumed run is."""
    from flowattn.sets import SetsRunConfig
    from flowattn.sets.config import build_flow

    config = SetsRunConfig.build({"data": "dw4", "blocks": 2})
    flows = [build_flow(config.flow, dim=2, set_size=4, zero_com=True).double()
             for _ in range(2)]
    x = torch.randn(16, 4, 2, dtype=DT)
    flows[0].log_prob(x - x.mean(1, keepdim=True))  # data-dependent initialisation, eagerly
    flows[1].load_state_dict(flows[0].state_dict())
    return flows[1]


def test_closed_form_blocks_compile_layer_by_layer_without_graph_breaks():
    """Blocks whose log-det is the determinant of the branch's closed-form Jacobian are traced
    whole (no eager autograd log-det), and layers of one kind share one compiled graph; a flow
    loaded from a state dict (a resumed run) reads nothing back either."""
    torch.manual_seed(2)
    torch._dynamo.utils.counters.clear()  # (dynamo's reset keeps the counts of earlier tests)
    flow = _particle_flow()
    layers = len(flow.transform._transforms)
    compiled = flow.compiled_log_prob(backend="aot_eager")
    params = [p for p in flow.parameters() if p.requires_grad]
    for _ in range(2):
        x = torch.randn(8, 4, 2, dtype=DT)
        x = x - x.mean(1, keepdim=True)
        results = [(value, torch.autograd.grad(value.sum(), params))
                   for value in (compiled(x), flow.log_prob(x))]  # compiled first
        (v2, g2), (v1, g1) = results
        _assert_same(v1, v2)
        for a, b in zip(g1, g2, strict=True):
            _assert_same(a, b)
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    # one graph per kind of layer (4), and one more for the first layer, whose input needs no
    # gradient: not one per layer
    assert 1 <= counters["stats"]["unique_graphs"] <= 5 < layers


@pytest.mark.parametrize("location", [False, True])
def test_spline_layers_compile_without_graph_breaks(location):
    """The element-wise spline couplings (and the centroid flow's autoregressive splines) trace
    whole, so a residual flow with splines compiles layer by layer into one graph per kind of
    layer, with the eager log-densities and gradients; nflows' spline broke every spline
    layer's graph, and nflows' ActNorm in the centroid flow its own (it read its flag)."""
    torch.manual_seed(3)
    flow = set_flow(dim=2, blocks=2, heads=1, interaction="linear", splines=True,
                    location=location).double()
    with torch.no_grad():
        for p in flow.parameters():
            p.add_(0.3 * torch.randn_like(p))  # splines away from the identity
    x = 2 * torch.randn(16, 5, 2, dtype=DT)
    flow.log_prob(x)  # the ActNorms' data-dependent initialisation
    twin = copy.deepcopy(flow)  # (the Lipschitz MLPs' power iterations move on at every call)
    torch._dynamo.utils.counters.clear()
    compiled = twin.compiled_log_prob(backend="aot_eager")
    results = []
    for log_prob, model in ((compiled, twin), (flow.log_prob, flow)):
        if model is flow:
            with torch.no_grad():  # the eager pass with which compiled_log_prob starts
                flow.log_prob(x)
        value = log_prob(x)
        results.append((value, torch.autograd.grad(value.sum(), list(model.parameters()))))
    (v2, g2), (v1, g1) = results
    _assert_same(v1, v2)
    for a, b in zip(g1, g2, strict=True):
        _assert_same(a, b)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert not breaks, breaks
