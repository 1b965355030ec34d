"""How tight are the certificates of tied L2 attention? Certificate / optimised lower bound.

``--attention induced`` measures induced-point attention (``InducedL2MHA`` with ``--inducing``
points per head, certified in the mixed norm only) the same way.

For L2MHA with random (Glorot) weights, for every set size N, width D and head count H of the
grid and each norm, prints the certificate (the tight one of ``docs/attention.md`` and
Theorem 3.2), the best lower bound on the Lipschitz constant found by maximising the Jacobian
norm over inputs, and their ratio. A ContractiveL2MHA with coefficient c divides F by the same
certificate, so the largest Jacobian norm it reaches on these weights is c / ratio; the table
gives it for c = 0.9.

Lower bounds (each value found is a valid lower bound, Kim et al. 2021, App. H):

* inf and 2,inf: by permutation equivariance the supremum of the norm of block row 0 of the
  Jacobian is the Lipschitz constant; block row 0 (D rows) is taken by D backward passes and
  its norm (largest absolute row sum; max over unit u of sum_k ||J_0k^T u||_2) maximised.
* 2: u^T J v with unit u, v from a power iteration that is warm-started at every step
  (each value is <= ||J||_2), maximised over X; the best input is re-evaluated with a long
  power iteration.

All restarts form one batch (independent sets, element-wise Adam: the same as separate runs).
Initial inputs X ~ s N(0, 1) with s log-uniform on [0.1, 10] d^{1/4} / max_h ||W^{Q,h}||_2 (the
scale at which the softmax is neither uniform nor one-hot), learning rate 0.05 s. For the
2-norm a second batch (``--structured-2``) starts from the core's worst configurations
(docs/attention.md, step 7): one element midway between two clusters of about (N - 1) / 2
elements each, placed along the top singular direction of one head's query weights (or of all
heads' together) at a core distance of 1.6-2.0, with a little noise; the larger of the two
batches' values is the lower bound.

    python benchmarks/bound_tightness.py                     # the full grid, inf and 2
    python benchmarks/bound_tightness.py --norms 2,inf       # the mixed norm
    python benchmarks/bound_tightness.py --quick
    python benchmarks/bound_tightness.py --attention induced --norms 2,inf --inducing 4 16
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time

import torch
from entry import run_main
from machine import cpu_name

from flowattn.attention import L2MHA, InducedL2MHA


def initial_inputs(module: L2MHA, n: int, restarts: int, generator: torch.Generator):
    """Random sets (R, N, D) at scales around the one where attention is informative."""
    wq = module.head_weights(module.w_q).detach()
    base = module.head_dim**0.25 / float(torch.linalg.matrix_norm(wq, 2).max())
    exponent = 2 * torch.rand(restarts, 1, 1, generator=generator, dtype=torch.float64) - 1
    scale = base * 10.0**exponent
    x = torch.randn(restarts, n, module.dim, generator=generator, dtype=torch.float64) * scale
    return x, scale


def structured_inputs(module: L2MHA, n: int, restarts: int, generator: torch.Generator):
    """Sets (R, N, D) in the core's worst arrangement for the 2-norm: element 0 midway between
    two clusters along the top singular direction of W^{Q,h} (h = r mod (H + 1); h = H: all
    heads' [W^{Q,1}, ..., W^{Q,H}]), at core distance u ~ U[1.6, 2.0] from each, plus noise of
    5 % of the cluster distance; returns the sets and their scales (largest |x_ij|)."""
    wq = module.head_weights(module.w_q).detach()  # (H, D, d)
    heads, dim, head_dim = wq.shape
    sets = []
    for r in range(restarts):
        h = r % (heads + 1)
        w = wq[h] if h < heads else wq.permute(1, 0, 2).reshape(dim, heads * head_dim)
        left, sigma, _ = torch.linalg.svd(w, full_matrices=False)
        u = 1.6 + 0.4 * torch.rand((), generator=generator, dtype=torch.float64)
        spread = u * head_dim**0.25 / sigma[0]  # |z_i - z_0| = u on that head
        shift = int(torch.randint(-2, 3, (), generator=generator))
        first = max(0, min(n - 1, (n - 1) // 2 + shift))  # elements on the negative side
        side = torch.ones(n, dtype=torch.float64)  # element 0 at the origin, the rest at -1 | +1
        side[0], side[1:first + 1] = 0.0, -1.0
        x = side[:, None] * spread * left[:, 0]
        noise = torch.randn(n, dim, generator=generator, dtype=torch.float64)
        sets.append(x + 0.05 * spread * noise)
    x = torch.stack(sets)
    return x, x.flatten(1).abs().amax(dim=1).view(-1, 1, 1)


def block_row_norm(module: L2MHA, x: torch.Tensor, u: torch.Tensor, norm: str):
    """Norm of block row 0 of the Jacobian of each set of x (R, N, D), differentiable in x."""
    out = module(x)[:, 0]  # (R, D)
    rows = []
    for a in range(module.dim):
        (grad,) = torch.autograd.grad(out[:, a].sum(), x, create_graph=True, retain_graph=True)
        rows.append(grad)
    jac = torch.stack(rows, dim=1)  # (R, D_out, N, D_in)
    if norm == "inf":
        return jac.abs().sum(dim=(2, 3)).amax(dim=1)
    unit = u / u.norm(dim=1, keepdim=True)
    return torch.einsum("ra,rakb->rkb", unit, jac).norm(dim=-1).sum(dim=-1)


def spectral_value(module: L2MHA, x, u, v, iterations: int):
    """u^T J v per set after ``iterations`` warm-started power steps (u, v updated in place)."""
    with torch.no_grad():
        for _ in range(iterations):
            _, jv = torch.func.jvp(module, (x.detach(),), (v,))
            u.copy_(jv / jv.flatten(1).norm(dim=1).view(-1, 1, 1))
            _, pullback = torch.func.vjp(module, x.detach())
            (jtu,) = pullback(u)
            v.copy_(jtu / jtu.flatten(1).norm(dim=1).view(-1, 1, 1))
    (jtu,) = torch.autograd.grad((module(x) * u).sum(), x, create_graph=True)
    return (jtu * v).flatten(1).sum(dim=1)


def lower_bound(module: L2MHA, n: int, norm: str, restarts: int, steps: int, seed: int,
                start=initial_inputs) -> float:
    g = torch.Generator().manual_seed(seed)
    x0, scale = start(module, n, restarts, g)
    # x = scale * y with Adam on y: each set moves at a rate proportional to its own scale
    y = (x0 / scale).requires_grad_(True)
    u = torch.randn(restarts, module.dim, generator=g, dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.Adam([y, u], lr=0.05)  # u (the 2,inf output direction) or unused
    pu = torch.randn(restarts, n, module.dim, generator=g, dtype=torch.float64)
    pv = torch.randn(restarts, n, module.dim, generator=g, dtype=torch.float64)
    pu /= pu.flatten(1).norm(dim=1).view(-1, 1, 1)
    pv /= pv.flatten(1).norm(dim=1).view(-1, 1, 1)
    best, best_x = -math.inf, None
    for step in range(steps + 1):
        xs = y * scale
        if norm == "2":
            value = spectral_value(module, xs, pu, pv, 8 if step == 0 else 2)
        else:
            value = block_row_norm(module, xs, u, norm)
        k = int(value.argmax())
        if value[k].item() > best:
            best, best_x = value[k].item(), xs[k].detach().clone()
        optimiser.zero_grad()
        (-value.sum()).backward()
        optimiser.step()
    if norm == "2":  # the best input, with a long power iteration (still a lower bound)
        x1 = best_x[None]
        u1, v1 = pu[:1].clone(), torch.randn(x1.shape, generator=g, dtype=torch.float64)
        v1 /= v1.norm()
        value = spectral_value(module, x1.requires_grad_(True), u1, v1, 300)
        best = max(best, float(value[0].detach()))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 32, 64])
    parser.add_argument("--dims", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--norms", nargs="+", default=["inf", "2"])
    parser.add_argument("--restarts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--restarts-2", type=int, default=16,
                        help="restarts for the 2-norm (its steps are cheap)")
    parser.add_argument("--steps-2", type=int, default=400)
    parser.add_argument("--structured-2", type=int, default=16,
                        help="2-norm restarts from the core's worst arrangement (0: none)")
    parser.add_argument("--parametrization", default="raw", choices=["raw", "orthogonal"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--coeff", type=float, default=0.9)
    parser.add_argument("--attention", default="l2", choices=["l2", "induced"])
    parser.add_argument("--inducing", type=int, nargs="+", default=[16],
                        help="inducing points per head (--attention induced)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.attention == "induced" and set(args.norms) != {"2,inf"}:
        parser.error("--attention induced is certified in the mixed norm only: --norms 2,inf")
    if args.attention == "l2":
        args.inducing = [None]
    if args.quick:
        args.sizes, args.dims, args.heads, args.restarts, args.steps = [2, 8], [4], [1, 2], 2, 20
        args.restarts_2, args.steps_2, args.structured_2 = 2, 20, 2
    torch.set_num_threads(torch.get_num_threads())
    print(f"torch {torch.__version__}, {cpu_name()}, {torch.get_num_threads()} thread(s); "
          f"{'L2MHA' if args.attention == 'l2' else 'InducedL2MHA'} ({args.parametrization}), "
          f"Glorot weights (seed {args.seed}), float64; "
          f"{args.restarts} restarts x {args.steps} Adam steps "
          f"({args.restarts_2} random and {args.structured_2} structured x {args.steps_2} "
          f"for the 2-norm)\n")
    print(f"| D | H | M | N | norm | tight | Thm 3.2 | lower bound | tight / lower | "
          f"Thm 3.2 / lower | contractive c={args.coeff} reaches | s |")
    print("| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    ratios: dict[str, list[float]] = {norm: [] for norm in args.norms}
    start = time.perf_counter()
    for dim, heads, inducing in itertools.product(args.dims, args.heads, args.inducing):
        if dim % heads:
            continue
        torch.manual_seed(args.seed)
        if args.attention == "l2":
            module = L2MHA(dim, heads, parametrization=args.parametrization).double()
        else:
            module = InducedL2MHA(dim, heads, inducing).double()
        for p in module.parameters():
            p.requires_grad_(False)
        for n in args.sizes:
            for norm in args.norms:
                t0 = time.perf_counter()
                with torch.no_grad():
                    if args.attention == "l2":
                        # the certificate of a full (not causal) call, as a contractive
                        # module dividing such a call takes it
                        tight = float(module.lipschitz_bound(n, norm, method="tight",
                                                             causal=False))
                    else:
                        tight = float(module.lipschitz_bound(n, norm))
                    old = (math.nan if norm == "2,inf"
                           else float(module.lipschitz_bound(n, norm, method="thm3.2")))
                restarts, steps = ((args.restarts_2, args.steps_2) if norm == "2"
                                   else (args.restarts, args.steps))
                lower = lower_bound(module, n, norm, restarts, steps, args.seed)
                if norm == "2" and args.structured_2 > 0 and args.attention == "l2":
                    lower = max(lower, lower_bound(module, n, norm, args.structured_2, steps,
                                                   args.seed, start=structured_inputs))
                if lower > tight * (1 + 1e-9):
                    raise AssertionError(f"certificate {tight} below a measured Jacobian "
                                         f"norm {lower} (D={dim}, H={heads}, N={n}, {norm})")
                ratios[norm].append(tight / lower)
                print(f"| {dim} | {heads} | {inducing or '-'} | {n} | {norm} | {tight:.4g} | "
                      f"{old:.4g} | {lower:.4g} | {tight / lower:.2f} | {old / lower:.1f} | "
                      f"{args.coeff * lower / tight:.3f} | {time.perf_counter() - t0:.0f} |",
                      flush=True)
    print()
    for norm, values in ratios.items():
        print(f"{norm}: tight / lower bound over {len(values)} cases: min {min(values):.2f}, "
              f"median {statistics.median(values):.2f}, max {max(values):.2f}")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    run_main(main)
