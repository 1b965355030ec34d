"""Fitting a flow to a collection of sets: the model, data and loss the shared loop trains.

:func:`fit` plans the run folder (fresh, resumed or refused, see :mod:`flowattn.training.run`),
builds a :class:`SetsTask` — the splits, the flow and its negative log-likelihood per degree of
freedom — and hands it to :func:`flowattn.training.loop.train`; :func:`evaluate` scores sets
under a flow and :func:`load_flow` rebuilds the flow of a checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..attention import frozen_certificates
from ..data import (
    PARTICLE_SYSTEMS,
    SetData,
    load_dataset,
    random_orthogonal,
    random_signs,
    reflect_sets,
    rotate_sets,
)
from ..errors import ConfigError, DataError, NonFiniteError
from ..flows.base import sample_standard_normal, set_dims
from ..flows.coupling import SetCoupling
from ..flows.geometry import probe_stream
from ..flows.residual import InvertibleResidual
from ..flows.setflow import SetFlow
from ..progress import progress_batches
from ..training.checkpoint import read_model, unbuildable
from ..training.cli import counted
from ..training.device import check_compilable
from ..training.distributed import Distributed
from ..training.loop import train as train_loop
from ..training.memory import check_fits, pass_bytes, state_bytes
from ..training.run import data_fingerprint, plan_run
from ..validation import trusted_inputs
from .boltzmann import regularised_energy
from .budget import eval_batch_size
from .config import (
    SetsRunConfig,
    build_flow,
    legacy_settings,
    resolved_field,
    resolved_interaction,
)

__all__ = ["SetsTask", "fit", "evaluate", "load_flow"]


class _LogProb(nn.Module):
    """log p(x) as a module's forward, so DistributedDataParallel sees the computation; with
    base draws ``z``, also the configurations f⁻¹(z) and their log-densities (training by
    energy), in the same forward."""

    def __init__(self, flow: SetFlow, compile: bool = False):
        super().__init__()
        self.flow = flow
        # compiled layer by layer (SetFlow.compiled_log_prob): sharing the flow's parameters
        # the flow's own density (before a mirror average: training maximises its bound)
        self.log_prob = flow.compiled_log_prob() if compile else flow.component_log_prob

    def forward(self, x: Tensor, mask: Tensor | None, z: Tensor | None = None):
        log_prob = self.log_prob(x, mask)
        if z is None:
            return log_prob
        with trusted_inputs():  # the task's own base draws: no check (a host sync) per step
            return log_prob, self.flow.from_noise(z)


class _Matching(nn.Module):
    """The flow-matching loss of each set as a module's forward (what DistributedDataParallel
    wraps for ``objective: matching``), from the batch's own base draws and times."""

    def __init__(self, flow: SetFlow, alignment: str = "none"):
        super().__init__()
        self.flow = flow
        self.alignment = alignment

    def forward(self, x: Tensor, mask: Tensor | None, noise: Tensor, times: Tensor) -> Tensor:
        # the task standardised the flow (isotropic for euclidean alignment) and checked the
        # data on loading: no per-step checks of either (host syncs)
        with trusted_inputs():
            return self.flow.matching_loss(x, mask, noise=noise, times=times,
                                           alignment=self.alignment)


def _batch(data: SetData, index: Tensor, device) -> tuple[Tensor, Tensor | None]:
    mask = None if data.mask is None else data.mask[index].to(device)
    return data.x[index].to(device), mask


def evaluate(flow: SetFlow, data: SetData, batch_size: int = 256, limit: int | None = None,
             device=None, progress: bool = False) -> dict:
    """Deterministic NLL of ``data`` under ``flow`` (evaluation mode: exact log-det if feasible).

    Sets are scored ``batch_size`` at a time, fewer for large sets (:func:`eval_batch_size`);
    ``progress`` reports the sets scored so far (:func:`~flowattn.progress.progress_batches`: a bar
    on a terminal, a line a minute in a log), for long evaluations such as a continuous flow's
    exact trace.

    Returns NLL in nats per set (``nll``), per degree of freedom (``nll_per_dim``; (n - 1) D per
    set in zero-centre-of-mass mode, the E-NF convention), their standard errors from the
    probes of estimated log-determinants (``nll_se``, ``nll_per_dim_se``: 0 where every
    log-det is exact, ``None`` where a continuous flow estimates its divergence or a
    mirror-averaged flow (``symmetry``) estimates log-dets), the standard
    errors of the means over the finite set of scored sets (``nll_sampling_se``,
    ``nll_per_dim_sampling_se``; ``None`` for fewer than 2 sets), ``logdet``
    (``"exact"`` or ``"estimated"``) and the number of sets.

    The sampling errors say how far the mean over these sets may lie from the expected NLL of
    sets from the same distribution. With per-set NLLs y_s, their mean ȳ and standard deviation
    s_y over n sets, the per-set error is s_y / √n; the per-dimension NLL r = Σ y_s / Σ d_s
    (d_s degrees of freedom of set s) is a ratio of means, whose error to first order is
    √(Σ_s (y_s − r d_s)² / (n (n − 1))) / d̄. Where log-dets are estimated, each y_s also
    carries its own independent probe noise (the pass draws its probes on from one stream,
    :func:`~flowattn.flows.geometry.probe_stream`), so these errors include the probes'.

    Raises:
        DataError: if a set has fewer than 2 elements in zero-centre-of-mass mode (its
            (n - 1) D-dimensional space is a point: it has no density).
        NonFiniteError: if a log-likelihood is not finite.
    """
    was_training = flow.training
    flow.eval()
    device = device or next(flow.parameters()).device
    count = len(data) if limit is None else min(limit, len(data))
    if flow.zero_com:
        sizes = data.sizes()[:count]
        if count and int(sizes.min()) < 2:
            first = int(torch.nonzero(sizes < 2)[0, 0])
            raise DataError(f"{data.name}: set {first} has {int(sizes[first])} element(s); in "
                            "the zero-centre-of-mass space a set needs at least 2 (one element "
                            "has no density in the (n - 1) D = 0-dimensional subspace)")
    batch_size = eval_batch_size(batch_size, data.set_size)
    residuals = [m for m in flow.modules() if isinstance(m, InvertibleResidual)]
    unknown = any(getattr(m, "eval_divergence", "exact") != "exact" for m in flow.modules())
    mirrored = flow.symmetry != "none"  # estimated log-dets pass through a log-sum-exp
    # sums over sets of the NLLs y, degrees of freedom d, y², y d and d², and of the probes'
    # variances: read back once for the whole split
    sums = torch.zeros(6, dtype=torch.float64, device=device)
    estimated = False
    # fixed weights: each attention bound once per set size; estimated log-dets draw their
    # probes on through the pass, so the sets' probe noise is independent (sampling errors)
    with frozen_certificates(), probe_stream():
        for batch in progress_batches(count, batch_size, f"evaluating {data.name}", progress,
                                      "set"):
            index = torch.arange(batch.start, batch.stop)
            x, mask = _batch(data, index, device)
            # no graph: a continuous flow would otherwise keep every solver step of the batch
            with torch.no_grad():
                log_prob = flow.log_prob(x, mask)
            y, d = -log_prob.double(), set_dims(x, mask, flow.zero_com).double()
            sums[:5] += torch.stack([y.sum(), d.sum(), y.square().sum(), (y * d).sum(),
                                     d.square().sum()])
            for block in residuals:  # independent probes: the variances add
                if block.logdet_variance is not None:
                    estimated = True
                    sums[5] += block.logdet_variance.double().sum()
    flow.train(was_training)
    nll, dims, *moments, variance = sums.tolist()
    if not math.isfinite(nll):
        largest = float(data.x.abs().max()) if data.x.numel() else 0.0
        raise NonFiniteError(
            f"non-finite log-likelihood while evaluating {data.name} (its coordinates reach "
            f"|x| = {largest:.3g}): the flow overflows on these sets; sets far outside the range "
            "of the training data need the training data's scale (rescale them as those were)")
    se = None if unknown or (mirrored and estimated) else math.sqrt(variance)
    sampling_se = _sampling_errors(nll, dims, moments, count)
    return {"nll": nll / count, "nll_per_dim": nll / dims,
            "nll_se": None if se is None else se / count,
            "nll_per_dim_se": None if se is None else se / dims,
            "nll_sampling_se": sampling_se[0], "nll_per_dim_sampling_se": sampling_se[1],
            "logdet": "estimated" if (estimated or unknown) else "exact", "num_sets": count}


def _sampling_errors(nll: float, dims: float, moments: list[float],
                     count: int) -> tuple[float | None, float | None]:
    """Standard errors of the mean NLL per set and of the ratio NLL per dimension.

    ``nll`` and ``dims`` are the sums Σ y_s and Σ d_s over ``count`` sets, ``moments`` the sums
    Σ y_s², Σ y_s d_s and Σ d_s² (see :func:`evaluate`).

    Examples:
        >>> _sampling_errors(6.0, 4.0, [20.0, 12.0, 8.0], 2)  # y = (2, 4), d = (2, 2)
        (1.0, 0.5)
    """
    if count < 2:
        return None, None
    square, cross, dims_square = moments
    mean = nll / count
    per_set = max(square - count * mean * mean, 0.0) / (count - 1)
    ratio = nll / dims
    residual = max(square - 2 * ratio * cross + ratio * ratio * dims_square, 0.0)
    per_dim = math.sqrt(residual * count / (count - 1)) / dims
    return math.sqrt(per_set / count), per_dim


#: sets whose centroids initialise the centroid flow's ActNorm when batches are smaller
INIT_SETS = 64


def _data_spec(train: SetData) -> dict:
    spec = {"name": train.name, "dim": train.dim, "set_size": train.set_size,
            "zero_com": train.zero_com, "variable_size": train.mask is not None}
    if train.mask is not None:  # how many training sets have n elements, n = 1 ... N
        counts = torch.bincount(train.sizes(), minlength=train.set_size + 1)
        spec["size_counts"] = counts[1:].tolist()
    return spec


class SetsTask:
    """A flow over sets: negative log-likelihood per degree of freedom, in nats.

    Arguments:
        config: the run's settings.
        dist: this process's place in the run (device, rank).
        progress: show the progress of generating built-in data.
        plots: draw samples and data side by side when the run finishes.
    """

    items = "sets"
    units = {"loss": "nats/dim", "nll": "nats/set"}  # of the validation metrics, as printed

    def __init__(self, config: SetsRunConfig, dist: Distributed, progress: bool = False,
                 plots: bool = True):
        self.config, self.dist, self.plots = config, dist, plots
        self.progress = progress and dist.is_main  # of the final test pass (and data loading)
        data = config.data
        # training by energy: E of the built-in particle system, and the base draws per step
        self.energy = PARTICLE_SYSTEMS[data.data].energy if config.flow.energy_weight > 0 \
            else None
        self.energy_samples = config.flow.energy_samples or config.train.batch_size
        shares = {"batch_size": config.train.batch_size}
        if self.energy is not None:
            shares["energy_samples"] = self.energy_samples
        for name, count in shares.items():  # each process takes its share: none may be empty
            if count < dist.world:
                raise ConfigError(f"{name}={count} is smaller than the number of processes "
                                  f"({dist.world}): give at least {dist.world}")
        sizes = None if data.num_train is None else {"train": data.num_train}
        splits = load_dataset(data.data, sizes, seed=config.train.seed,
                              progress=progress and dist.is_main, set_size=data.set_size)
        self.train_data, self.val_data = splits["train"], splits["val"]
        self.test_data = splits.get("test", self.val_data)
        torch.manual_seed(config.train.seed)  # identical initial weights in every process
        flow = build_flow(config.flow, self.train_data.dim, self.train_data.set_size,
                          self.train_data.zero_com)
        # The data's offset and scale, from the training split (saved with the flow's state):
        # the layers see standardised sets, the likelihood stays that of the raw data.
        # (one scale for every direction where base draws are turned towards the data)
        flow.standardise(self.train_data.x, self.train_data.mask,
                         isotropic=config.flow.alignment == "euclidean")
        self.flow = flow.to(dist.device)
        self.model = self.flow
        # the ODE solvers of a continuous flow, whose evaluation counts the metrics report
        self.solvers = [m for m in self.flow.modules() if hasattr(m, "nfe_forward")]
        if config.train.compile:
            check_compilable(dist.device)
        self.matching = config.flow.objective == "matching"
        if self.matching and not hasattr(self.flow.transform, "matching_loss"):
            raise ConfigError("objective=matching trains a continuous flow alone: these data "
                              "get a centroid flow before it; give location false")
        if config.flow.alignment == "euclidean" and not self.train_data.zero_com:
            raise ConfigError("alignment=euclidean turns base draws by rotations and "
                              "reflections about the centre of mass: it is for particle "
                              "systems (zero-centre-of-mass data), whose law is invariant "
                              "under them; use alignment=permutation for other sets")
        if self.matching and config.train.compile:
            raise ConfigError("compile is a setting of likelihood training: a flow-matching "
                              "step is one field evaluation (give compile false)")
        # what DistributedDataParallel wraps; with compile, the training step's log-density is
        # compiled (evaluation and sampling stay eager)
        self.forward_module = _Matching(self.flow, config.flow.alignment) if self.matching else \
            _LogProb(self.flow, compile=config.train.compile)
        self._energy_stats: dict[str, Tensor] = {}

    def describe(self) -> list[str]:
        """Lines for the run's log: the data's splits and shape, and the flow."""
        train, flow = self.train_data, self.config.flow
        sizes = f"{train.set_size}" if train.mask is None else f"up to {train.set_size}"
        splits = [f"{len(train):,} training", f"{len(self.val_data):,} validation"]
        if self.test_data is not self.val_data:
            splits.append(f"{len(self.test_data):,} test")
        data = (f"data: {self.config.data.data}, {', '.join(splits)} sets of {sizes} elements "
                f"in R^{train.dim}" + (", centre of mass at 0" if train.zero_com else ""))
        if flow.flow == "resflow":
            inside = [part for wanted, part in ((flow.splines, "an element-wise spline coupling"),
                                                (flow.pair_splines, "a layer of pair splines"))
                      if wanted]
            interaction = resolved_interaction(flow, train.zero_com)
            kind = (f"residual flow, {counted(flow.blocks, 'block')}"
                    + (f" (each with {' and '.join(inside)})" if inside else "")
                    + (", no interaction" if interaction == "none"
                       else f", {interaction} interaction")
                    + (f", then {counted(flow.coupling_layers, 'set-coupling layer')}"
                       if flow.coupling_layers else ""))
        elif flow.flow == "cnf":
            kind = f"continuous flow, {resolved_field(flow, train.zero_com)} field"
        else:
            couplings = sum(isinstance(m, SetCoupling) for m in self.flow.modules())
            kind = f"set-coupling flow, {counted(couplings, 'layer')}"
        if flow.preset != "none":
            kind += f" (preset {flow.preset})"
        count = sum(p.numel() for p in self.flow.parameters())
        return [data, f"flow: {kind}, {count:,} parameters"]

    def initialise(self) -> None:
        """Data-dependent initialisation (ActNorm) on a batch every process shares.

        The centroid flow's ActNorm sees one centroid per set: for batches smaller than
        ``INIT_SETS`` sets (large sets) it is initialised from the centroids of the first
        ``INIT_SETS`` training sets instead (a cheap pass; no attention).
        """
        size = min(len(self.train_data), self.config.train.batch_size)
        if size < INIT_SETS:
            count = min(len(self.train_data), INIT_SETS)
            self.flow.initialise_location(*_batch(self.train_data, torch.arange(count),
                                                  self.dist.device))
        x, mask = _batch(self.train_data, torch.arange(size), self.dist.device)
        with torch.no_grad():  # values only: a continuous flow would keep its solve's graph
            # the flow's own density: a mirror average (symmetry) starts where the flow
            # trained on mirrored sets (augment) starts, and follows the same steps
            self.flow.component_log_prob(x, mask)

    def check_memory(self) -> None:
        """Refuse a batch whose training step would not fit in the device's memory
        (:mod:`flowattn.training.memory`): the tensors one set's log-density saves for the
        backward pass, times the sets of this process's step. A continuous flow trained
        through its solver needs about 150 MB per set with the EGNN field; on a CPU the
        operating system would otherwise kill the run without a word. (Flow matching
        evaluates the field once per set: nothing to check.)"""
        if self.matching:
            return
        saved = pass_bytes(self.flow, lambda k: self.flow.component_log_prob(
            *_batch(self.train_data, torch.zeros(k, dtype=torch.long), self.dist.device)))
        items, what = self.config.train.batch_size, "batch_size"
        if self.energy is not None:  # the configurations drawn for the reverse KL, alike
            items, what = items + self.energy_samples, "batch_size + energy_samples"
        flow, hints = self.config.flow, []
        if flow.flow == "cnf" and not flow.adjoint:
            hints.append("--adjoint (memory independent of the solver's steps)")
        if any(getattr(m, "divergence", None) == "exact" for m in self.solvers):
            hints.append("--divergence hutchinson (one probe per set instead of one backward "
                         "pass per dimension)")
        check_fits(saved, items, self.dist.device, processes=self.dist.world, what=what,
                   hints=tuple(hints),
                   state=state_bytes(self.flow, self.config.train.ema is not None))

    def batch(self, generator: torch.Generator, dist: Distributed):
        size = self.config.train.batch_size
        index = torch.randint(len(self.train_data), (size,), generator=generator)
        x, mask = _batch(self.train_data, index[dist.rank :: dist.world], dist.device)
        if self.config.data.augment == "rotations":  # drawn for the whole batch: every process
            q = random_orthogonal(size, x.shape[-1], generator)  # keeps its share of it
            x = rotate_sets(x, mask, q[dist.rank :: dist.world])
        elif "reflections" in (self.config.data.augment, self.config.flow.symmetry):
            signs = random_signs(size, x.shape[-1], generator)
            x = reflect_sets(x, signs[dist.rank :: dist.world])
        if self.matching:  # the base draws and times, for the whole batch
            shape = (size, self.train_data.set_size, self.train_data.dim)
            noise = torch.randn(shape, generator=generator, dtype=x.dtype)
            times = self.config.flow.t1 * torch.rand(size, generator=generator, dtype=x.dtype)
            share = slice(dist.rank, None, dist.world)
            return x, mask, noise[share].to(dist.device), times[share].to(dist.device)
        if self.energy is None:
            return x, mask
        # base draws for training by energy, from the same generator (so a resumed run draws
        # what an uninterrupted one would), shared out as the batch is
        shape = (self.energy_samples, self.train_data.set_size, self.train_data.dim)
        z = sample_standard_normal(shape, None, True, generator, dtype=x.dtype)
        return x, mask, z[dist.rank :: dist.world].to(dist.device)

    def loss(self, module: nn.Module, batch):
        r"""The NLL per dimension, plus the weighted extras (per dimension too): RNODE's
        penalties, and for training by energy the reverse KL up to log Z,
        E_q[E_reg(x) + log q(x)] over configurations x = f⁻¹(z) of the batch's base draws z
        (:func:`~flowattn.sets.boltzmann.regularised_energy`). The value logged as the
        training loss is the NLL alone. With ``objective: matching`` the objective and the
        logged loss are the flow-matching loss per dimension
        (:meth:`~flowattn.flows.SetFlow.matching_loss`)."""
        x, mask, *draws = batch
        dims = set_dims(x, mask, self.train_data.zero_com).mean()
        if self.matching:  # the matching loss per dimension: objective and reported loss
            loss = module(x, mask, *draws).mean() / dims
            return loss, loss, x.shape[0]
        if draws:
            log_prob, (samples, log_q) = module(x, mask, draws[0])
        else:
            log_prob = module(x, mask)
        nll = -log_prob.mean() / dims
        flow = self.config.flow
        objective = nll
        if flow.kinetic_weight > 0 or flow.jacobian_weight > 0:
            penalty = sum(flow.kinetic_weight * cnf.kinetic_energy.mean()
                          + flow.jacobian_weight * cnf.jacobian_frobenius.mean()
                          for cnf in self.flow.modules() if hasattr(cnf, "kinetic_energy"))
            objective = objective + penalty / dims
        if draws:
            energy = regularised_energy(self.energy, samples, flow.energy_max)
            reverse = (energy + log_q).mean()
            objective = objective + flow.energy_weight * reverse / dims
            self._energy_stats = {"reverse_kl": reverse.detach(),
                                  "sample_energy": energy.detach().mean()}
        return objective, nll, x.shape[0]

    def train_stats(self) -> dict[str, float]:
        """Field evaluations of the latest forward and backward solve (continuous flows trained
        by likelihood);
        training by energy: the latest E_q[E_reg + log q] (``reverse_kl``, nats per
        configuration: KL(q ‖ p) - log Z) and mean E_reg of the samples."""
        stats: dict[str, float] = {name: float(value)
                                   for name, value in self._energy_stats.items()}
        if self.solvers and not self.matching:  # flow matching trains without solves
            stats.update(nfe_forward=sum(int(m.nfe_forward) for m in self.solvers),
                         nfe_backward=sum(int(m.nfe_backward) for m in self.solvers))
        return stats

    def evaluate(self, dist: Distributed) -> dict[str, float]:
        result = evaluate(self.flow, self.val_data, limit=self.config.data.val_sets)
        metrics = {"loss": result["nll_per_dim"], "nll": result["nll"]}
        if self.solvers:  # how hard the flow is to integrate: the last batch's solve
            metrics["nfe"] = sum(int(m.nfe_forward) for m in self.solvers)
        return metrics

    def finish(self, out: Path) -> dict[str, Any]:
        test = self.test_data
        split = test.name.rsplit("/", 1)[-1] if "/" in test.name else "val"
        result = evaluate(self.flow, test, progress=self.progress)
        report = {"test": result, "test_split": split, "test_nll": result["nll"],
                  "test_nll_per_dim": result["nll_per_dim"], "test_sets": result["num_sets"],
                  "test_nll_se": result["nll_se"], "test_nll_per_dim_se": result["nll_per_dim_se"],
                  "test_nll_sampling_se": result["nll_sampling_se"],
                  "test_nll_per_dim_sampling_se": result["nll_per_dim_sampling_se"],
                  "test_logdet": result["logdet"]}
        true_nll = test.mean_true_nll()
        if true_nll is not None:
            dims = set_dims(test.x, test.mask, test.zero_com).double().mean().item()
            report.update(true_nll=true_nll, true_nll_per_dim=true_nll / dims)
        if self.plots:
            from .plots import plot_run

            report["plots"] = [str(p) for p in plot_run(self.flow, test, out,
                                                        self.config.train.seed)]
        return report

    def state(self) -> dict[str, Any]:
        return {"data": _data_spec(self.train_data)}


def _fingerprint(config: SetsRunConfig) -> dict:
    source = config.data.data
    if source.endswith(".npz") or Path(source).is_file():
        return data_fingerprint(source)
    return {"source": source, "sha256": None}  # built-in: defined by the settings


def fit(
    config: SetsRunConfig | None = None,
    out: str | Path = "runs/sets",
    *,
    resume: bool = False,
    file: str | Path | None = None,
    flags: Mapping[str, Any] | None = None,
    progress: bool = True,
    tensorboard: bool | None = None,
    plots: bool = True,
) -> dict:
    """Fit a flow to sets; return the summary (also written to ``out/summary.json``).

    From Python, pass ``config`` (a :class:`SetsRunConfig`); the command line passes the config
    file and the flags the user typed. ``resume=True`` continues the run in ``out`` exactly
    where its checkpoint left off; only the settings in ``SetsRunConfig.RESUMABLE`` may differ
    from the stored ones. A finished run is not trained again (the summary comes back with
    ``finished: True``).

    The summary holds the test NLL (``test_nll`` per set, ``test_nll_per_dim``) on the test
    split of a built-in data set, or on the validation split of a user's file
    (``test_split`` says which), the true NLL where the data have a closed-form density, and
    the paths of the plots.
    """
    if config is not None:
        flags = {**config.flat(), **(flags or {})}
    plan = plan_run(out, "sets", SetsRunConfig, resume=resume, file=file, flags=flags,
                    fingerprint=_fingerprint)
    if plan.finished:
        import json

        return {**json.loads((plan.out / "summary.json").read_text()), "finished": True}
    if plan.config.train.threads is not None:
        torch.set_num_threads(plan.config.train.threads)
    ctx = Distributed.join(plan.config.train.device)
    try:
        task = SetsTask(plan.config, ctx, progress=progress, plots=plots)
        if ctx.is_main:
            for line in task.describe():
                print(line, flush=True)
        return train_loop(task, plan, ctx, progress=progress, tensorboard=tensorboard)
    except BaseException:
        if ctx.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        raise


def load_flow(checkpoint: str | Path, device: str | torch.device = "cpu") -> tuple[SetFlow, dict]:
    """The flow saved in a run folder (or checkpoint file), in evaluation mode, and its record.

    The record has at least ``step``, ``config`` (a :class:`SetsRunConfig`), ``data`` (the
    training data's name, D, set size, zero-CoM flag) and ``version``.

    Raises:
        CheckpointError: naming the file, if it is missing, unreadable or not a sets checkpoint.
    """
    record = read_model(checkpoint, "sets", map_location=device)
    try:
        if record["version"] == 1:
            config = SetsRunConfig.build(legacy_settings(record["config"]), record["path"])
            spec = record["data"]
        else:
            config = SetsRunConfig.build(record["config"], record["path"])
            spec = record["task"]["data"]
        flow = build_flow(config.flow, spec["dim"], spec["set_size"], spec["zero_com"])
        flow = flow.to(device)
        flow.load_state_dict(record["model"])
    except (KeyError, TypeError, RuntimeError, ConfigError) as err:
        raise unbuildable(record, "a set flow", err) from None
    return flow.eval(), {**record, "config": config, "data": spec}
