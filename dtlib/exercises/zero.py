"""Checkers for Chapter 4, "ZeRO and FSDP"."""

from __future__ import annotations

import random
from typing import Any, Callable

import torch

from dtlib.collectives.accounting import count_comms
from dtlib.exercises import WrongAnswer, checker, passed, run_on_ranks
from dtlib.memory.formulas import model_state_bytes
from dtlib.runtime.i18n import N_, _

BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-8, 0.01


def _adamw(p, g, m, v, step, lr, bias_correction=True, decay=True, eps=EPS):
    b1, b2 = BETAS
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    t = step + 1
    mh, vh = (m / (1 - b1 ** t), v / (1 - b2 ** t)) if bias_correction else (m, v)
    if decay:
        p = p * (1 - lr * WEIGHT_DECAY)
    return p - lr * mh / (vh.sqrt() + eps)


def _case(world_size: int, numel: int, seed: int, tiny: bool = False):
    """Padded parameters, one gradient per rank, this shard's moments. ``tiny``: fresh
    moments (zero) and gradients of about ``eps``, zero on every rank in the first
    half of each shard, where Adam's ``eps`` decides the step (0 / 0 without it)."""
    gen = torch.Generator().manual_seed(seed)
    if tiny:
        padded = -(-numel // world_size) * world_size
        shard = padded // world_size
        params = torch.randn(padded, generator=gen)
        zero = (torch.arange(padded) % shard) < shard // 2
        grads = [torch.where(zero, 0.0, torch.randn(padded, generator=gen) * EPS)
                 for _ in range(world_size)]
        return params, grads, torch.zeros(shard), torch.zeros(shard)
    padded = -(-numel // world_size) * world_size
    params = torch.zeros(padded)
    params[:numel] = torch.randn(numel, generator=gen)
    grads = []
    for _ in range(world_size):
        g = torch.zeros(padded)
        g[:numel] = torch.randn(numel, generator=gen)
        grads.append(g)
    shard = padded // world_size
    m = torch.randn(shard, generator=gen) * 0.1
    v = torch.rand(shard, generator=gen) * 0.1
    return params, grads, m, v


#: What ``check_zero1_shard_step`` switches off while the learner's function runs.
_ZERO1_SHARD_STEP_FORBIDS = {
    'dtlib.exercises.zero:_adamw': N_("the checker's truth"),
    'dtlib.zero.optimizer:ShardedOptimizer.step': N_("the book's own ZeRO-1 step"),
}


@checker(forbids=_ZERO1_SHARD_STEP_FORBIDS)
def check_zero1_shard_step(fn: Callable[..., torch.Tensor],
                           seed: int | None = None) -> None:
    """Check ``fn(params, grads, rank, exp_avg, exp_avg_sq, step, lr)``.

    ``params``: the padded flat parameters (every rank holds them all in ZeRO-1);
    ``grads``: one padded flat gradient per rank (``len(grads)`` is the world size);
    ``exp_avg``/``exp_avg_sq``: AdamW's moments *of this rank's shard only*;
    ``step``: steps taken so far. ``fn`` returns this rank's updated shard after one
    AdamW step (betas (0.9, 0.999), eps 1e-8, weight_decay 0.01) on the averaged
    gradient, which is what the reduce-scatter delivers.

    The page's four cases and three drawn from ``seed``: worlds of 1 to 6 ranks,
    sizes that do not divide them, any step, one with fresh moments and gradients
    near eps.
    """
    rng = random.Random(seed)
    drawn = tuple((rng.randint(1, 6), rng.randint(1, 50), rng.randint(0, 20), tiny,
                   rng.randrange(2 ** 31)) for tiny in (False, False, True))
    for world_size, numel, step, tiny, base in ((4, 37, 3, False, 40),
                                                (2, 10, 0, False, 20),
                                                (3, 30, 7, False, 30),
                                                (2, 12, 0, True, 20), *drawn):
        lr = 1e-2
        for rank in range(world_size):
            params, grads, m, v = _case(world_size, numel, base + rank, tiny)
            shard = params.numel() // world_size
            lo, hi = rank * shard, (rank + 1) * shard
            mean = torch.stack(grads).mean(0)
            want = _adamw(params[lo:hi], mean[lo:hi], m, v, step, lr)
            got = fn(params.clone(), [g.clone() for g in grads], rank, m.clone(),
                     v.clone(), step, lr)
            where = _("world_size={world_size}, rank={rank}, {numel} "
                      "parameters").format(
                        world_size=world_size, rank=rank, numel=numel) + (
                _(", fresh moments and gradients near eps (some zero on every rank)")
                if tiny else "")
            if not torch.is_tensor(got) or got.shape != want.shape:
                shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
                raise WrongAnswer(
                    _("{where}: expected a tensor of shape {shape} (the shard: padded "
                      "size / world_size), got {shape2}").format(
                        where=where, shape=tuple(want.shape), shape2=shape))
            # A right answer differs from ``want`` only by float32 rounding in another
            # order (sum then divide vs mean, the moments' updates): a few ulps of the
            # O(1) parameters (u = 6e-8, so ~1e-7), plus lr (1e-2) times a few ulps of
            # m / sqrt(v) (v >= 0.001 * g**2 here, far above eps). atol 1e-6 and rtol
            # 1e-5 leave ten times that; every wrong answer below moves the shard by
            # ~lr = 1e-2.
            # In the tiny case every step is lr * m_hat / (sqrt(v_hat) + eps) with
            # m_hat and sqrt(v_hat) about eps: float32 keeps its 2**-24 relative
            # precision down there, so the same bound holds; a missing or changed eps
            # moves a step by a sizeable part of lr (or makes it 0 / 0).
            if torch.allclose(got, want, atol=1e-6, rtol=1e-5):
                continue
            if got.isnan().any():
                raise WrongAnswer(
                    _("{where}: your shard has NaN where the gradient and both "
                      "moments are zero.").format(where=where), _(
                              "AdamW divides by sqrt(v_hat) + eps (eps = 1e-8): the "
                              "eps keeps 0 / 0 out"))
            hints = [
                (_adamw(params[lo:hi], mean[lo:hi] * world_size, m, v, step, lr),
                 _("you used the summed gradient: the reduce-scatter sums, divide by "
                   "the world size")),
                (_adamw(params[lo:hi], grads[rank][lo:hi], m, v, step, lr),
                 _("you used this rank's local gradient: average over all ranks "
                   "first")),
                (_adamw(params[lo:hi], mean[lo:hi], m, v, step, lr,
                        bias_correction=False),
                 _("bias correction is missing: divide m by 1 - beta1**t and v by "
                   "1 - beta2**t with t = step + 1")),
                (_adamw(params[lo:hi], mean[lo:hi] + WEIGHT_DECAY * params[lo:hi],
                        m, v, step, lr, decay=False),
                 _("that is Adam with L2 regularisation: the decay was added to the "
                   "gradient, so it went through m and v. AdamW decouples it: "
                   "multiply p by 1 - lr * weight_decay, and give the moments the "
                   "gradient alone")),
                (_adamw(params[lo:hi], mean[lo:hi], m, v, step, lr, decay=False),
                 _("weight decay is missing: AdamW multiplies p by "
                   "1 - lr * weight_decay")),
                (_adamw(params[lo:hi], mean[lo:hi], m, v, step, lr, eps=0.0),
                 _("eps is missing: AdamW divides by sqrt(v_hat) + eps")),
            ]
            hint = next((h for alt, h in hints if torch.allclose(got, alt, atol=1e-6)),
                        _("rank {rank} owns elements [{lo}, {hi}) of the flat "
                          "buffer").format(rank=rank, lo=lo, hi=hi))
            raise WrongAnswer(_("{where}: wrong updated shard. Hint: {hint}").format(
                                  where=where, hint=hint))
    passed(_("your ZeRO-1 shard step matches AdamW on the averaged gradient shard"))


_TERMS = {"params": N_("parameters (2 bytes each)"),
          "grads": N_("gradients (2 bytes each)"),
          "optimizer": N_("optimizer state (12 bytes each)")}


#: What ``check_stage_memory`` switches off while the learner's function runs.
_STAGE_MEMORY_FORBIDS = {
    'dtlib.memory.formulas:model_state_bytes': N_("the checker's truth"),
    'dtlib.memory.formulas:bytes_per_param': N_("the book's formula"),
    'dtlib.memory.formulas:estimate': N_("the book's planner"),
    'dtlib.zero.fsdp:fsdp_state_bytes': N_("the book's own count"),
    'dtlib.zero.deepspeed_engine:deepspeed_state_bytes': N_("the book's own count"),
}


@checker(forbids=_STAGE_MEMORY_FORBIDS)
def check_stage_memory(fn: Callable[[int, int, int], dict[str, int]],
                       seed: int | None = None) -> None:
    """Check ``fn(n_params, zero_stage, world_size)`` -> ``{"params": bytes,
    "grads": bytes, "optimizer": bytes}``: each model state's bytes per device for
    mixed-precision Adam (2 + 2 + 12 bytes per parameter, ZeRO paper K = 12), sharded
    terms rounded up to whole parameters per rank.

    Each term is checked on its own: a total cannot tell "stage 2 shards the
    gradients" from "stage 2 shards the parameters" (both save 2 bytes a parameter).
    Beyond the page's cases, four are drawn from ``seed`` (any stage, 1 to 1024
    ranks, sizes that do not divide them).
    """
    rng = random.Random(seed)
    drawn = tuple((rng.randint(1, 10 ** 11), stage, rng.randint(1, 1024))
                  for stage in rng.sample(range(4), 4))
    for n, stage, world_size in ((7_500_000_000, 0, 64), (7_500_000_000, 1, 64),
                                 (7_500_000_000, 2, 64), (7_500_000_000, 3, 64),
                                 (1001, 3, 4), (1001, 2, 4), (7_000_000_000, 3, 8),
                                 *drawn):
        truth = model_state_bytes(n, zero_stage=stage, dp=world_size)
        got = fn(n, stage, world_size)
        where = _("n_params={n}, zero_stage={stage}, world_size={world_size}").format(
                    n=n, stage=stage, world_size=world_size)
        if not isinstance(got, dict) or set(got) != set(_TERMS):
            raise WrongAnswer(_("{where}: return a dict with the keys {terms} (bytes "
                                "per device of each model state), got {got!r}").format(
                                  where=where, terms=sorted(_TERMS), got=got))
        for key, term in _TERMS.items():
            name = _(term)
            want = getattr(truth, key)
            if got[key] == want:
                continue
            shard = -(-n // world_size)
            per = {"params": 2, "grads": 2, "optimizer": 12}[key]
            sharded = want == per * shard
            if sharded and got[key] == per * n / world_size:
                hint = _("shard sizes round up: use ceil(n_params / world_size)")
            else:
                hint = (_("is the {name} split over the ranks at stage {stage}? Stage "
                          "by stage, ZeRO shards one more state ('The three "
                          "stages')").format(name=name, stage=stage))
            verdict = (_("should be sharded") if sharded and got[key] > want else
                       _("should not be sharded") if not sharded and got[key] < want
                       else _("is not right"))
            raise WrongAnswer(_("{where}: the {name}: got {got!r}; at this stage this "
                                "term {verdict}.").format(
                                  where=where, name=name, got=got[key],
                                  verdict=verdict), hint)
    passed(_("your per-device bytes of each model state match the ZeRO paper for "
             "stages 0-3"))


# ---- build it: ZeRO-2's gradient reduce-scatter, as a hook, on real ranks ------------

def _zero2_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    # Every parameter's numel (32, 8, 32, 4) divides by 2 and by 4: no padding to teach.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 4)).to(dtype)


def _zero2_batch(rank: int, dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(3, 4, generator=gen).to(dtype),
            torch.randn(3, 4, generator=gen).to(dtype))


def _zero2_dtype(world_size: int) -> torch.dtype:
    """The model's dtype on each world the check runs: float64 from 4 ranks on, so a
    shard made in the default dtype is caught."""
    return torch.float64 if world_size >= 4 else torch.float32


def _zero2_on_rank(hook: Callable[[torch.nn.Parameter], None]) -> dict[str, Any]:
    """On every rank: the learner's hook on every parameter, one backward."""
    import torch.distributed as dist

    dtype = _zero2_dtype(dist.get_world_size())
    model = _zero2_model(dtype)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    x, y = _zero2_batch(dist.get_rank(), dtype)
    # count_comms names each collective once, whichever spelling the hook used
    # (reduce_scatter_single; reduce_scatter over a list; reduce_scatter_tensor, the
    # older name, which calls reduce_scatter_single where that exists);
    # torch.distributed's functions only, as a hook calls them (no dispatch mode)
    with count_comms() as log:
        torch.nn.functional.mse_loss(model(x), y).backward()
    return {"shards": [getattr(p, "grad_shard", None) for p in model.parameters()],
            "grads_freed": [p.grad is None for p in model.parameters()],
            "comms": [r.op for r in log.records]}


def _zero2_truth(world_size: int) -> list[torch.Tensor]:
    """The averaged gradient of every parameter, flattened, from one process."""
    grads = []
    dtype = _zero2_dtype(world_size)
    for rank in range(world_size):
        model = _zero2_model(dtype)
        x, y = _zero2_batch(rank, dtype)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.reshape(-1) for p in model.parameters()])
    return [torch.stack(per).mean(0) for per in zip(*grads)]


#: What ``check_zero2_hook`` switches off while the learner's function runs.
_ZERO2_HOOK_FORBIDS = {
    'dtlib.exercises.zero:_zero2_truth': N_("the checker's truth"),
}


@checker(forbids=_ZERO2_HOOK_FORBIDS)
def check_zero2_hook(hook: Callable[[torch.nn.Parameter], None],
                     world_sizes: tuple[int, ...] = (2, 4)) -> None:
    """Check ``hook(param)``, registered with ``register_post_accumulate_grad_hook``.

    ZeRO-2: once a parameter's gradient is complete on a rank, one reduce-scatter
    leaves in ``param.grad_shard`` this rank's shard of the gradient averaged over the
    ranks (elements ``rank * k : (rank + 1) * k`` of the flattened gradient,
    ``k = numel / world_size``) and the full ``param.grad`` is freed (``None``).
    """
    names = ("0.weight", "0.bias", "2.weight", "2.bias")
    for n in world_sizes:
        truth = _zero2_truth(n)
        try:
            ranks = run_on_ranks(_zero2_on_rank, hook, n, what=_(
                    "your ZeRO-2 hook"))
        except WrongAnswer as exc:
            if "is deprecated" not in str(exc):
                raise
            raise WrongAnswer(
                _("on {n} ranks your ZeRO-2 hook calls a collective under a name this "
                  "torch ({version}) deprecates.").format(
                    n=n, version=torch.__version__), _(
                            "use dist.reduce_scatter_single (Chapter 2), falling back "
                            "to the older name only where torch lacks it: "
                            "getattr(dist, 'reduce_scatter_single', None) or "
                            "dist.reduce_scatter_tensor")
            ) from None
        for r, res in enumerate(ranks):
            where = _("world_size={n}, rank {r}").format(n=n, r=r)
            other = sorted({c for c in res["comms"] if c != "reduce_scatter"})
            if other:
                raise WrongAnswer(
                    _("{where}: your hook calls {other}.").format(
                        where=where, other=other), _(
                                "ZeRO-2 never needs the whole averaged gradient on a "
                                "rank: a reduce-scatter (dist.reduce_scatter_single, "
                                "or dist.reduce_scatter over a list of chunks) "
                                "delivers only this rank's shard, half the traffic of "
                                "an all-reduce ('The three stages')."))
            if res["comms"].count("reduce_scatter") != len(names):
                raise WrongAnswer(_("{where}: {n_res_comms} reduce-scatters for "
                                    "{n_names} parameters; one per parameter.").format(
                                      where=where, n_res_comms=len(res['comms']),
                                      n_names=len(names)))
            for name, got, freed, full in zip(names, res["shards"],
                                              res["grads_freed"], truth):
                k = full.numel() // n
                want = full[r * k:(r + 1) * k]
                if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                    raise WrongAnswer(
                        _("{where}, {name}: param.grad_shard should be a tensor of "
                          "{k} elements (numel / world_size), got {value!r}.").format(
                            where=where, name=name, k=k,
                            value=tuple(got.shape) if torch.is_tensor(got) else got))
                if got.dtype != want.dtype:
                    raise WrongAnswer(_("{where}, {name}: the model is {dtype}, your "
                                        "shard is {dtype2}.").format(
                                          where=where, name=name, dtype=want.dtype,
                                          dtype2=got.dtype), _(
                                                  "make the shard in the gradient's "
                                                  "dtype (dtype=flat.dtype)"))
                if torch.allclose(got, want * n, rtol=1e-5, atol=1e-7):
                    raise WrongAnswer(_("{where}, {name}: the shard is world_size "
                                        "times too large: the reduce-scatter "
                                        "sums.").format(where=where, name=name),
                                      _("average: divide by the world size"))
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-7):
                    raise WrongAnswer(_("{where}, {name}: the shard differs from this "
                                        "rank's slice of the averaged "
                                        "gradient.").format(where=where, name=name),
                                      _("reduce-scatter the flattened gradient "
                                        "(param.grad.reshape(-1)); rank r receives "
                                        "elements r*k to (r+1)*k"))
                if not freed:
                    raise WrongAnswer(_("{where}, {name}: param.grad still holds the "
                                        "full gradient.").format(
                                          where=where, name=name), _(
                                                  "ZeRO-2 saves memory only if the "
                                                  "full gradient is dropped: "
                                                  "param.grad = None"))
    passed(_("your hook reduce-scatters each gradient and keeps only the shard, on "
             "{world_sizes} ranks").format(world_sizes=list(world_sizes)))
