"""torch.compile of the language models: compiled logits and gradients are the eager ones, and
a run trained with ``--compile`` writes the checkpoint an eager run writes."""

import copy

import pytest
import torch

import flowattn.training.device as device
from flowattn.attention import L2MHA
from flowattn.errors import ConfigError
from flowattn.lm.config import LMConfig, LMRunConfig
from flowattn.lm.model import build_model
from flowattn.lm.train import LMTask, eager_state_dict, load_checkpoint, train
from flowattn.training.checkpoint import read_checkpoint, save_checkpoint
from flowattn.training.device import NO_COMPILER, cpp_compiler
from flowattn.training.distributed import Distributed

needs_compiler = pytest.mark.skipif(cpp_compiler() is None, reason=NO_COMPILER)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")

TEXT = "the quick brown fox jumps over the lazy dog. " * 60
DT = torch.float64

VARIANTS = {
    "dp": dict(attention="dp"),
    "l2-tied": dict(attention="l2-tied"),
    "l2-tied-self-offset": dict(attention="l2-tied", self_offset=4.0),
    "l2-tied-position-bias": dict(attention="l2-tied", position_bias=4.0, max_distance=3),
    "l2-tied-offsets": dict(attention="l2-tied", self_offset=4.0, position_bias=4.0,
                            max_distance=3),
    "contractive-l2": dict(attention="contractive-l2"),
    "contractive-l2-mixed-offsets": dict(attention="contractive-l2", contractive_norm="2,inf",
                                         self_offset=4.0, position_bias=4.0, max_distance=3),
    "invertible": dict(invertible=True),
}


# Every variant is traced by dynamo and AOT autograd (``aot_eager``: the graphs inductor would
# receive, run eagerly); two also go through inductor's C++ code generation, which takes
# minutes per model on a cold cache for the contractive and invertible ones.
INDUCTOR = {"dp", "l2-tied-offsets"}


@pytest.fixture(autouse=True)
def fresh_compiler_caches():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tiny(**settings) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LMConfig(vocab_size=11, block_size=8, layers=2, dim=16, heads=2, **settings)
    return build_model(config).to(DT).train()


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiled_lm_gives_the_eager_logits_and_gradients_in_float64(variant):
    eager = _tiny(**VARIANTS[variant])
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="inductor" if variant in INDUCTOR else "aot_eager")
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second call reuses the graphs
        x = torch.randint(11, (3, 8), generator=generator)
        y = torch.randint(11, (3, 8), generator=generator)
        results = []
        for model, module in ((eager, eager), (compiled, twin)):
            logits, losses = model(x, y)
            grads = torch.autograd.grad(losses["loss"], list(module.parameters()))
            results.append((logits, losses["loss"], *grads))
        for a, b in zip(*results, strict=True):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), (a - b).abs().max()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # really compiled



@pytest.mark.parametrize("variant", ["dp", "l2-tied", "l2-tied-offsets", "scaled-cosine"])
def test_a_compiled_lm_breaks_its_graph_only_to_check_its_result(variant):
    """Nothing inside the stack reads a value back (no input checks, no choice of attention
    kernel): the one graph break is the stack's overflow check at its end. (Contractive
    attention also leaves the graph for its certificate, evaluated eagerly.)"""
    settings = VARIANTS.get(variant, {"attention": variant})
    model = _tiny(**settings)
    x = torch.randint(11, (3, 8), generator=torch.Generator().manual_seed(1))
    explanation = torch._dynamo.explain(model)(x, x)
    frames = [[frame.name for frame in r.user_stack] for r in explanation.break_reasons]
    assert frames and all(stack[-1] == "check_deferred" for stack in frames), frames
    # by design, so without torch.compile's warning: the check is a function it skips
    assert all("_check_results" in r.reason for r in explanation.break_reasons)


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("offsets", [{}, {"self_offset": 2.0}], ids=["fused", "written-out"])
def test_compiled_l2_attention_scales_huge_inputs_down_like_the_eager_one(offsets):
    """Compiled code has no host-synchronising test of the input's size: its down-scaling runs
    always, and must give the eager result where it matters (|x W| far beyond sqrt(max))."""
    torch.manual_seed(2)
    eager = L2MHA(16, 2, tied=True, **offsets)
    compiled = torch.compile(copy.deepcopy(eager))
    for magnitude in (1.0, 1e17, 1e18, 1e20):  # s = 1, 2, 4 and beyond the cap, per head
        x = (magnitude * torch.randn(2, 6, 16)).requires_grad_()
        results = []
        for attention in (eager, compiled):
            y = attention(x, causal=True)
            (grad,) = torch.autograd.grad((y * torch.linspace(-1, 1, 16)).sum(), x)
            results.append((y / magnitude, grad))
        for a, b in zip(*results, strict=True):
            assert torch.isfinite(b).all()
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- training runs


@pytest.fixture
def corpus(tmp_path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


def _run_config(corpus: str, **settings) -> LMRunConfig:
    base = dict(data=corpus, layers=1, dim=16, heads=2, block_size=16, batch_size=4, steps=4,
                eval_every=4, checkpoint_every=4, log_every=2, device="cpu",
                attention="l2-tied", self_offset=4.0)
    return LMRunConfig.build({**base, **settings})


@pytest.mark.slow
@needs_compiler
def test_compiled_run_writes_the_checkpoint_of_the_eager_run(corpus, tmp_path):
    eager = train(_run_config(corpus), tmp_path / "eager", progress=False, tensorboard=False)
    compiled = train(_run_config(corpus, compile=True), tmp_path / "compiled", progress=False,
                     tensorboard=False)
    assert compiled["step"] == eager["step"] == 4 and not compiled["diverged"]
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-5)
    saved = read_checkpoint(tmp_path / "compiled", "lm")
    assert saved["config"]["train"]["compile"] is True
    reference = read_checkpoint(tmp_path / "eager", "lm")["model"]
    assert list(saved["model"]) == list(reference)  # no "_orig_mod." prefix
    for key, value in reference.items():
        assert torch.allclose(saved["model"][key], value, rtol=1e-4, atol=1e-6), key
    model, record, vocab = load_checkpoint(tmp_path / "compiled")  # an eager model
    assert not isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert record["step"] == 4
    resumed = train(_run_config(corpus, steps=6, eval_every=2, checkpoint_every=2),
                    tmp_path / "compiled", resume=True, flags={"compile": False},
                    progress=False, tensorboard=False)  # and resumes without compile
    assert resumed["step"] == 6 and not resumed["diverged"]


@pytest.mark.parametrize("settings", [
    {},
    dict(attention="contractive-l2", self_offset=0.0, position_bias=0.0, contractive_norm="inf"),
], ids=["l2-tied", "contractive-l2-inf"])
def test_checkpoint_of_a_compiled_wrapper_loads_into_the_eager_model(corpus, tmp_path,
                                                                     settings):
    """Keys lose their prefix and the modules keep their versions: a contractive model read
    as a pre-tight one would get Theorem 3.2's bound and compute another function."""
    config = _run_config(corpus, **settings)
    task = LMTask(config, Distributed.join("cpu"))
    wrapper = torch.compile(task.model)  # nothing is compiled before its first call
    state = wrapper.state_dict()
    assert all(key.startswith("_orig_mod.") for key in state)
    assert list(eager_state_dict(state)) == list(task.model.state_dict())
    save_checkpoint({"kind": "lm", "config": config.to_dict(), "step": 0, "model": state,
                     "task": task.state()}, tmp_path / "checkpoint.pt")
    model, _, _ = load_checkpoint(tmp_path / "checkpoint.pt")
    for key, value in task.model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    x = torch.randint(task.corpus.vocab.size, (2, 8))
    assert torch.equal(model(x)[0], task.model.eval()(x)[0])  # the same function


def test_compile_without_a_cpp_compiler_is_refused_with_the_reason(corpus, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(device.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="--compile: .*no C\\+\\+ compiler"):
        LMTask(_run_config(corpus, compile=True), Distributed.join("cpu"))


def test_compile_with_a_cxx_that_is_not_installed_is_refused_naming_it(corpus, monkeypatch):
    # inductor takes $CXX alone when it is set: an installed g++ does not help then
    monkeypatch.setenv("CXX", "no-such-compiler++")
    assert device.cpp_compiler() is None
    with pytest.raises(ConfigError, match="CXX='no-such-compiler\\+\\+' is not an executable"):
        LMTask(_run_config(corpus, compile=True), Distributed.join("cpu"))


def test_compile_is_a_flag_of_lm_train_and_may_change_on_resume():
    from flowattn.cli import build_parser

    args = build_parser().parse_args(["lm", "train", "--compile"])
    assert args.compile is True
    assert "compile" in LMRunConfig.RESUMABLE
    assert LMRunConfig.build({}).train.compile is False
