"""Inputs are checked once, where they enter a flow; a layer called directly still checks."""

import logging

import pytest
import torch
from nflows.distributions import StandardNormal
from nflows.flows import Flow

import flowattn.validation as validation
from flowattn.attention import ContractiveL2MHA
from flowattn.branches import LipschitzMLP
from flowattn.errors import InputError, NonFiniteError
from flowattn.flows import (
    CNF,
    ActNorm,
    AttentionField,
    EquivariantLinear,
    InvertibleResidual,
    LogDetOptions,
    PairSplines,
    SetCoupling,
    SetFlow,
    SetLocation,
    TransformerResidualPair,
    coupling_flow,
    sequence_flow,
    set_flow,
)
from flowattn.validation import check_sets, trusted_inputs

SERIES = LogDetOptions("series", n_terms=3)


@pytest.fixture
def counted_checks(monkeypatch):
    """Count the checks that really run (check_finite is their host-synchronising part)."""
    calls = []
    original = validation.check_finite

    def counting(x, name="x"):
        calls.append(name)
        return original(x, name)

    monkeypatch.setattr(validation, "check_finite", counting)
    return calls


@pytest.mark.parametrize("interaction", ["attention", "linear"])
def test_a_flow_checks_its_inputs_once_not_in_every_layer(counted_checks, interaction):
    flow = set_flow(dim=2, blocks=3, heads=1, interaction=interaction, logdet=SERIES)
    x = torch.randn(4, 5, 2)
    flow.log_prob(x).mean().backward()
    assert len(counted_checks) == 1
    counted_checks.clear()
    with torch.no_grad():
        flow.eval().transform_to_noise(x)
    assert len(counted_checks) == 1


def test_a_flow_refuses_bad_inputs_at_its_entry_points():
    flow = set_flow(dim=2, blocks=2, heads=1)
    with pytest.raises(NonFiniteError, match="non-finite"):
        flow.log_prob(torch.tensor([[[float("nan"), 0.0]]]))
    with pytest.raises(NonFiniteError, match="non-finite"):
        flow.transform_to_noise(torch.tensor([[[float("inf"), 0.0]]]))
    with pytest.raises(InputError, match="empty"):
        flow.sample(2, mask=torch.tensor([[True, False], [False, False]]))
    with pytest.raises(InputError, match="width"):
        flow.log_prob(torch.randn(2, 3, 3))


@pytest.mark.parametrize(
    "layer",
    [
        InvertibleResidual(LipschitzMLP(2, 8), logdet=SERIES),
        ActNorm(2),
        ContractiveL2MHA(2, 1),
    ],
    ids=["residual block", "actnorm", "attention"],
)
def test_a_layer_called_directly_refuses_bad_inputs(layer):
    with pytest.raises(NonFiniteError, match="non-finite"):
        layer(torch.tensor([[[float("nan"), 0.0]]]))
    with pytest.raises(InputError, match="empty"):
        layer(torch.randn(2, 3, 2), torch.zeros(2, 3, dtype=torch.bool))


def test_the_inverse_of_a_block_called_directly_refuses_bad_inputs():
    block = InvertibleResidual(LipschitzMLP(2, 8), logdet=SERIES).eval()
    with pytest.raises(NonFiniteError, match="non-finite"):
        block.inverse(torch.tensor([[[float("nan"), 0.0]]]))


def test_checks_are_skipped_only_inside_trusted_inputs():
    bad = torch.full((1, 2, 3), float("nan"))
    with trusted_inputs():
        assert check_sets(bad) is None
        assert validation.inputs_trusted()
    assert not validation.inputs_trusted()
    with pytest.raises(NonFiniteError):
        check_sets(bad)


def test_trust_ends_when_the_entry_point_raises():
    flow = set_flow(dim=2, blocks=1, heads=1)
    with pytest.raises(InputError):
        flow.log_prob(torch.randn(2, 3, 5))
    assert not validation.inputs_trusted()


def test_a_training_step_reads_no_tensor_back_but_the_entry_check(host_reads):
    torch.manual_seed(0)
    flow = set_flow(dim=2, blocks=3, heads=1, interaction="linear", logdet=SERIES)
    x = torch.randn(8, 5, 2)
    flow.log_prob(x)  # ActNorm's data-dependent initialisation reads its flag once

    reads = host_reads(lambda: flow.log_prob(x).mean().backward())
    assert sum(reads.values()) == 1 and all("validation.py" in k for k in reads), reads


@pytest.mark.parametrize("flow_kind", ["splines", "pair-splines", "location", "coupling"])
def test_spline_layers_read_no_tensor_back(host_reads, flow_kind):
    """The splines select their interval without reading anything back (nflows' spline reads
    up to three values a call, nflows' ActNorm its flag), so a step of a residual flow with
    splines and a centroid flow reads only the entry check; in a coupling flow (splines, and
    the centroid flow's autoregressive splines) no read comes from a spline or an ActNorm (its
    dot-product conditioner reads on the CPU, as attention does)."""
    torch.manual_seed(0)
    if flow_kind == "coupling":
        flow = coupling_flow(dim=2, layers=2, hidden=16, blocks=1)
    else:
        flow = set_flow(dim=2, blocks=2, heads=1, interaction="linear", logdet=SERIES,
                        splines=flow_kind in ("splines", "location"),
                        pair_splines=flow_kind == "pair-splines", location=flow_kind == "location")
    x = 3 * torch.randn(8, 5, 2)  # some coordinates outside the splines' intervals
    flow.log_prob(x)  # ActNorm's data-dependent initialisation reads its flag once

    reads = host_reads(lambda: flow.log_prob(x).mean().backward())
    spline_files = ("splines.py", "layers.py", "pairs.py", "coupling.py", "rational_quadratic.py",
                    "autoregressive.py", "normalization.py")
    assert not [k for k in reads if k.startswith(spline_files)], reads
    if flow_kind != "coupling":
        assert sum(reads.values()) == 1 and all("validation.py" in k for k in reads), reads


def test_a_flow_loaded_from_a_state_dict_reads_no_tensor_back_in_its_first_step(host_reads):
    """A resumed run: ActNorm's flag is read when the state is loaded, not in the step (where
    under torch.compile the read would break the graph)."""
    torch.manual_seed(0)
    trained = set_flow(dim=2, blocks=3, heads=1, interaction="linear", logdet=SERIES)
    x = torch.randn(8, 5, 2)
    trained.log_prob(x)
    flow = set_flow(dim=2, blocks=3, heads=1, interaction="linear", logdet=SERIES)
    flow.load_state_dict(trained.state_dict())

    reads = host_reads(lambda: flow.log_prob(x).mean().backward())
    assert sum(reads.values()) == 1 and all("validation.py" in k for k in reads), reads


@pytest.mark.parametrize("masked", [False, True])
def test_attention_blocks_defer_their_overflow_check_to_the_entry_point(masked, host_reads):
    """An attention residual's certificate reads nothing back (its counts stay on the host),
    nor does the down-scaling of huge queries; the attention blocks' overflow checks are
    deferred to the flow's entry point, which checks its results once."""
    torch.manual_seed(0)
    flow = set_flow(dim=3, blocks=2, heads=1, logdet=SERIES)
    x = torch.randn(4, 5, 3)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 0]],
                        dtype=torch.bool) if masked else None
    flow.log_prob(x, mask)  # ActNorm's data-dependent initialisation

    reads = host_reads(lambda: flow.log_prob(x, mask).mean().backward())
    entry = 2 if masked else 1  # finiteness, and the mask's empty-set test
    assert sum(reads.values()) == entry + 1, reads  # and 1 for the deferred overflow check
    assert all(k.startswith("validation.py") for k in reads), reads


def test_an_overflow_inside_a_flow_is_caught_at_its_entry_point(monkeypatch):
    """A layer that overflows inside a flow no longer raises by itself (its check is
    deferred), but the flow's results are checked once: NaN never leaves the flow."""
    torch.manual_seed(0)
    flow = set_flow(dim=3, blocks=2, heads=1, logdet=SERIES)
    x = torch.randn(4, 5, 3)
    flow.log_prob(x)
    attention = next(m for m in flow.modules() if isinstance(m, ContractiveL2MHA)).attention
    forward, linearise = type(attention).forward, type(attention).linearise

    def overflowing(self, x, *args, **kwargs):  # an output that overflowed, checked as usual
        return validation.check_output(forward(self, x, *args, **kwargs) * float("inf"), x,
                                       "L2MHA")

    def overflowing_linearise(self, x, *args, **kwargs):
        y, vjp = linearise(self, x, *args, **kwargs)
        return validation.check_output(y * float("inf"), x, "L2MHA"), vjp

    monkeypatch.setattr(type(attention), "forward", overflowing)
    monkeypatch.setattr(type(attention), "linearise", overflowing_linearise)
    with pytest.raises(NonFiniteError, match="SetFlow overflowed"):
        flow.log_prob(x)
    with pytest.raises(NonFiniteError, match="L2MHA overflowed"):  # called directly: at once
        attention(x)
    assert not validation.inputs_trusted()


def test_a_certificate_that_is_not_a_number_is_caught_at_the_flow_entry_point(monkeypatch):
    """A NaN certificate (weights too large for their dtype) is not read back inside a flow;
    it stays NaN in the division (it was taken as 1, leaving a finite map that is not a
    contraction), so the flow's results are NaN and its entry point raises."""
    torch.manual_seed(0)
    flow = set_flow(dim=3, blocks=2, heads=1, logdet=SERIES)
    x = torch.randn(4, 5, 3)
    flow.log_prob(x)
    attention = next(m for m in flow.modules() if isinstance(m, ContractiveL2MHA))
    monkeypatch.setattr(type(attention), "_certificate",
                        lambda self, counts, causal: torch.tensor(float("nan")))
    with pytest.raises(NonFiniteError, match="SetFlow overflowed"):
        flow.log_prob(x)
    with pytest.raises(NonFiniteError, match="bound of ContractiveL2MHA is NaN"):  # directly
        attention(x)
    assert not validation.inputs_trusted()


def test_an_overflow_inside_compiled_layers_is_caught_at_the_flow_entry_point(monkeypatch):
    """Compiled layers defer their overflow check too, and the note that they did survives
    the compiled code (a list's mutation, replayed; the rebinding of an attribute would be
    dropped): the entry point checks its results, and NaN never leaves a compiled flow."""
    torch.manual_seed(0)
    flow = set_flow(dim=3, blocks=1, heads=1, logdet=SERIES)
    x = torch.randn(4, 5, 3)
    flow.log_prob(x)
    attention = next(m for m in flow.modules() if isinstance(m, ContractiveL2MHA)).attention
    linearise = type(attention).linearise

    def overflowing_linearise(self, x, *args, **kwargs):  # in training: the compiled pass
        y, vjp = linearise(self, x, *args, **kwargs)
        if torch.is_grad_enabled():
            y = y * float("inf")
        return validation.check_output(y, x, "L2MHA"), vjp

    monkeypatch.setattr(type(attention), "linearise", overflowing_linearise)
    torch._dynamo.reset()
    try:
        log_prob = flow.compiled_log_prob(backend="eager")
        with pytest.raises(NonFiniteError, match="SetFlow overflowed"):
            log_prob(x)  # (the first call's eager pass, without gradients, passes)
    finally:
        torch._dynamo.reset()
    assert not validation.inputs_trusted()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("scale", [1.0, float("inf")], ids=["finite", "overflow"])
def test_the_deferred_check_leaves_compiled_code_without_a_graph_break_warning(scale):
    """The entry point's one read-back is a graph break by design: torch.compile skips it as
    a function run eagerly (and warns of nothing), and it still catches an overflow."""
    def entry(x):
        with trusted_inputs():
            y = validation.check_output(x * scale, x, "layer")  # deferred
        validation.check_deferred(x, "entry", y)
        return y + 1

    records = _Records()
    logger = logging.getLogger("torch._dynamo")  # where torch logs graph breaks
    logger.addHandler(records)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(entry, backend="eager")
        if scale == 1.0:
            assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
        else:
            with pytest.raises(NonFiniteError, match="entry overflowed"):
                compiled(torch.ones(3))
    finally:
        logger.removeHandler(records)
        torch._dynamo.reset()
    assert not [m for m in records.messages if "Graph break" in m], records.messages


# -- what a transform called directly must refuse, and what it must keep --------------------

def _blocks():
    return {
        "attention block": InvertibleResidual(ContractiveL2MHA(2, 1), logdet=SERIES),
        "attention and MLP": TransformerResidualPair(ContractiveL2MHA(2, 1),
                                                     LipschitzMLP(2, 8), logdet=SERIES),
        "actnorm": ActNorm(2),
        "equivariant linear": EquivariantLinear(2),
        "set location": SetLocation(2),
        "set coupling": SetCoupling(2, 0, 8, blocks=1),
        "pair splines": PairSplines(2),
    }


@pytest.mark.parametrize("name", list(_blocks()))
def test_a_transform_refuses_another_width_an_empty_batch_and_another_dtype(name):
    layer = _blocks()[name]
    with pytest.raises(InputError, match=r"width D=3, but the module expects D=2"):
        layer(torch.randn(3, 4, 3))
    with pytest.raises(InputError, match=r"no sets \(B=0\)"):
        layer(torch.randn(0, 4, 2))
    with pytest.raises(InputError, match=r"inputs has dtype torch.float64, but the \w+'s "
                                         r"weights are torch.float32"):
        layer(torch.randn(3, 4, 2, dtype=torch.float64))
    layer.double()
    assert layer(torch.randn(3, 4, 2, dtype=torch.float64))[0].dtype == torch.float64


def test_the_inverse_of_a_block_refuses_another_dtype_as_nflows_sampling_would_give_it():
    # nflows' StandardNormal draws float32 noise whatever the flow's dtype
    flow = Flow(InvertibleResidual(LipschitzMLP(2, 8), logdet=SERIES),
                StandardNormal([4, 2])).double().eval()
    with pytest.raises(InputError, match=r"dtype torch.float32, but the LipschitzMLP's "
                                         r"weights are torch.float64"):
        flow.sample(3)
    block = InvertibleResidual(LipschitzMLP(2, 8), logdet=SERIES).eval()
    with pytest.raises(InputError, match=r"no sets \(B=0\)"):
        block.inverse(torch.randn(0, 4, 2))


def test_a_set_flow_refuses_another_dtype_and_an_empty_batch_at_every_entry_point():
    flow = set_flow(dim=2, blocks=1, heads=1).eval()
    x64 = torch.randn(3, 4, 2, dtype=torch.float64)
    for call in (flow.log_prob, flow.transform_to_noise, flow.from_noise):
        with pytest.raises(InputError, match="float64, but the SetFlow's weights are"):
            call(x64)
        with pytest.raises(InputError, match=r"B=0"):
            call(torch.randn(0, 4, 2))
    flow.double()
    assert flow.log_prob(x64).dtype == torch.float64


@pytest.mark.parametrize("context", [{"masks": "m"}, {}, {"mask": "m", "extra": None}],
                         ids=["misspelt", "empty", "extra entry"])
def test_a_dict_context_without_its_one_mask_entry_is_refused_not_dropped(context):
    block = InvertibleResidual(ContractiveL2MHA(2, 1), logdet=LogDetOptions("exact"))
    x, m = torch.randn(1, 4, 2), torch.tensor([[True, True, True, False]])
    context = {k: (m if v == "m" else v) for k, v in context.items()}
    with pytest.raises(InputError, match="one entry, 'mask'"):
        block(x, context)
    assert torch.equal(block(x, {"mask": m})[1], block(x, m)[1])
    assert torch.equal(block(x, {"mask": None})[1], block(x)[1])


def test_a_continuous_flow_takes_the_mask_in_a_dict_as_every_transform_does():
    cnf = CNF(AttentionField(2, heads=1, layers=1, hidden=8))
    x, m = torch.randn(2, 4, 2), torch.tensor([[True, True, True, False]] * 2)
    assert torch.allclose(cnf(x, {"mask": m})[1], cnf(x, m)[1])
    with pytest.raises(InputError, match="one entry, 'mask'"):
        cnf(x, {"masks": m})


def test_zero_com_flows_give_no_density_to_one_element_sets_and_need_centred_noise():
    flow = set_flow(dim=2, blocks=1, heads=1, zero_com=True).eval()
    one = torch.tensor([[True, True, False], [True, False, False]])
    with pytest.raises(InputError, match="set 1 has 1 element"):
        flow.sample_and_log_prob(2, mask=one)
    with pytest.raises(InputError, match="set 1 has 1 element"):
        flow.sample(2, mask=one)
    with pytest.raises(InputError, match="set 0 has 1 element"):
        flow.sample(2, set_size=1)
    with pytest.raises(InputError, match="1 element"):
        flow.from_noise(torch.randn(2, 1, 2))
    z = torch.randn(2, 3, 2)
    with pytest.raises(InputError, match="must be centred"):
        flow.from_noise(z)  # off the subspace: its log q would not be the flow's density
    x, log_q = flow.from_noise(z - z.mean(dim=1, keepdim=True))
    assert torch.allclose(log_q, flow.log_prob(x), atol=1e-4)


@pytest.mark.parametrize("arguments", [dict(dim=0), dict(heads=0), dict(blocks=1.5),
                                       dict(hidden=0), dict(blocks=True)],
                         ids=["dim 0", "heads 0", "blocks 1.5", "hidden 0", "blocks True"])
def test_the_builders_refuse_counts_that_are_not_positive_integers(arguments):
    name = next(iter(arguments))
    settings = {"dim": 2, "blocks": 1, "heads": 1, **arguments}
    with pytest.raises(InputError, match=f"{name} must be an integer >= 1"):
        set_flow(**settings)
    with pytest.raises(InputError, match=f"{name} must be an integer >= 1"):
        sequence_flow(**settings)


def test_sampling_refuses_counts_that_are_not_positive_integers():
    flow = set_flow(dim=2, blocks=1, heads=1).eval()
    with pytest.raises(InputError, match="set_size must be an integer >= 1, got 2.5"):
        flow.sample(2, set_size=2.5)
    with pytest.raises(InputError, match="num_samples must be an integer >= 1, got 0"):
        flow.sample(0, set_size=3)


@pytest.mark.parametrize("dim", [0, -1, 2.5, True])
def test_a_set_flow_refuses_a_width_that_is_not_a_positive_integer(dim):
    # it was kept, and failed later inside torch.zeros (or only at the first call)
    base = set_flow(dim=2, blocks=1, heads=1)
    with pytest.raises(InputError, match="dim must be an integer >= 1"):
        SetFlow(base.transform, dim=dim)


@pytest.mark.parametrize("layer", [ActNorm, EquivariantLinear])
@pytest.mark.parametrize("dim", [0, -2, 2.5, True])
def test_element_wise_layers_refuse_a_width_that_is_not_a_positive_integer(layer, dim):
    # a width 0 was built (and 2.5 failed inside torch.zeros)
    with pytest.raises(InputError, match=f"^dim must be an integer >= 1, got {dim!r}$"):
        layer(dim)
