"""Step time, throughput and memory of one parallel configuration.

Step time is a sum; by default nothing overlaps, so it is an upper bound that
states what each part costs (Narayanan et al. 2021 measure how much overlap
recovers). With ``overlap=True`` the data-parallel traffic follows Chapter 13's
overlap rules (``planner.overlap.two_streams``): ZeRO 0-2's gradient buckets
(25 MiB) hide behind the last micro-batch's backward except the last bucket
(ZeRO 1-2's parameter all-gather after the step stays exposed); ZeRO-3 gathers
layer i+1 behind layer i, forward and backward, and reduce-scatters layer i behind
layer i-1's backward. Tensor-, context- and pipeline-parallel traffic stays on the
critical path either way. The default stays ``overlap=False``: on Narayanan et al.'s
Table 2 the rule lifts every ZeRO-3 run more than 25 % above its published throughput
(charging every byte keeps them within Chapter 11's 25 %), and it moves Table 1 and
Llama 3 by a few percent at most (Chapter 13, "The planner with time").

- compute: FLOPs per iteration (``counts.flops_per_iteration``) over
  n_gpus x peak_flops x compute_efficiency;
- bubble: compute x the schedule's idle over its ideal step (``pipeline_bubble``):
  (pp - 1) / m for non-interleaved 1F1B (Chapter 6; Narayanan §2.2.1); for the
  zero-bubble schedules, with F, B and W a third of the compute each (the backward
  twice the forward, split evenly), ZB-H1 idles max(pp - 1, 2pp - 1 - m) and ZB-V
  max((pp - 1)/2, 2pp - 1 - m) of those thirds (Chapter 6's ideal clock; Qi et
  al. 2024);
- tp: per layer and micro-batch, 2 all-reduces forward and 2 backward (f and g,
  Chapter 5), 2 more forward under full recomputation, each of the 2sbh-byte
  activation, on NVLink when the tp group fits in a node;
- cp: per layer and micro-batch, an all-gather of K and V forward, a
  reduce-scatter of their gradients backward (one more all-gather under full
  recomputation);
- pp: per micro-batch one activation forward and one gradient backward between
  neighbouring stages (scattered over tp with sequence parallelism); twice as many
  under ZB-V, whose ranks hold two stages each;
- dp: the 16-bit gradients of this rank's parameters, once per iteration:
  all-reduce (ZeRO 0) or reduce-scatter + all-gather of the parameters (ZeRO 1, 2:
  the same bytes); ZeRO-3 gathers the parameters forward and backward and
  reduce-scatters the gradients for every micro-batch.

Collectives cost what Chapter 2's alpha-beta ring model says
(``dtlib.collectives.cost_model.collective_time``). Ranks are laid out as
``arange(world).view(dp, pp, cp, tp)``: tp neighbours are adjacent GPUs, so a group
uses NVLink when its span of ranks fits in a node and divides it (tp 6 on 8-GPU
nodes straddles nodes), and otherwise each GPU's own NIC (``inter_node_bw``).

Taught in: Chapter 11, a planner checked against published runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlib.collectives.cost_model import collective_time

from dtlib.planner.counts import flops_per_iteration, param_count
from dtlib.planner.overlap import Comm, two_streams
from dtlib.planner.footprint import memory_breakdown
from dtlib.planner.specs import PP_SCHEDULES, ClusterSpec, ModelSpec, ParallelConfig

TIME_TERMS = ("compute", "bubble", "tp", "cp", "pp", "dp")


def pipeline_bubble(schedule: str, pp: int, m: int) -> float:
    """The pipeline's idle time over its ideal compute, on Chapter 6's ideal clock:
    ``(pp - 1) / m`` for 1F1B; for ZB-H1 and ZB-V, with F, B and W a third of a
    micro-batch's compute each, ``max(pp - 1, 2pp - 1 - m) / 3m`` and ``max((pp -
    1)/2, 2pp - 1 - m) / 3m`` (``tests/test_planner.py`` holds them to Chapter 6's
    ``simulate`` and ``play_v``).

    Taught in: Chapter 11, a planner checked against published runs.
    """
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {PP_SCHEDULES}")
    for name, v in (("pp", pp), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if schedule == "1f1b":
        return (pp - 1) / m
    fill = pp - 1 if schedule == "zb-h1" else (pp - 1) / 2
    return max(fill, 2 * pp - 1 - m) / (3 * m)
_WHAT = {"compute": "compute", "bubble": "the pipeline bubble",
         "tp": "tensor-parallel all-reduces", "cp": "context-parallel K/V exchange",
         "pp": "pipeline sends", "dp": "data-parallel gradient traffic"}


@dataclass(frozen=True)
class Breakdown:
    """Where the time and the memory go.

    time_s: seconds per iteration for each of ``TIME_TERMS``.
    memory_bytes: params, grads, optimizer, activations on the first stage.
    links: "intra" or "inter" for each communicating dimension.
    memory_limit_bytes: what a GPU may use (memory minus reserved).
    """

    time_s: dict[str, float]
    memory_bytes: dict[str, float]
    links: dict[str, str]
    memory_limit_bytes: float

    @property
    def dominant(self) -> str:
        """What limits this configuration: "memory" when it does not fit, else
        the largest time term other than compute (or "compute" when the
        overheads together are below a tenth of it)."""
        if sum(self.memory_bytes.values()) > self.memory_limit_bytes:
            return "memory"
        over = {k: v for k, v in self.time_s.items() if k != "compute"}
        worst = max(over, key=over.get)
        if sum(over.values()) < 0.1 * self.time_s["compute"]:
            return "compute"
        return worst

    def explain(self) -> str:
        """One paragraph: the time terms as shares of the step, the memory."""
        total = sum(self.time_s.values())
        parts = [f"{_WHAT[k]} {v / total:.0%}" + (
            f" ({self.links[k]}-node)" if k in self.links else "")
            for k, v in sorted(self.time_s.items(), key=lambda kv: -kv[1]) if v > 0]
        mem = sum(self.memory_bytes.values())
        biggest = max(self.memory_bytes, key=self.memory_bytes.get)
        verdict = {"memory": "it does not fit in memory",
                   "compute": "compute dominates"}.get(
            self.dominant, f"{_WHAT[self.dominant]} cost the most beyond compute")
        return (f"Step {total:.3g} s: " + ", ".join(parts) + f". Memory "
                f"{mem / 1e9:.1f} GB of {self.memory_limit_bytes / 1e9:.1f} GB, "
                f"mostly {biggest}. Verdict: {verdict}.")


@dataclass(frozen=True)
class Estimate:
    """What one configuration costs (units: bytes, FLOPs, seconds).

    memory_per_gpu_bytes: model states + activations on the most loaded GPU.
    fits: memory_per_gpu_bytes <= memory_bytes - reserved_bytes.
    flops_per_iteration: model FLOPs plus recomputation (Eq. 3 when "full").
    model_flops_per_iteration: without recomputation (for MFU).
    step_time_s: the sum of ``breakdown.time_s``.
    tflops_per_gpu: flops_per_iteration / step_time / n_gpus / 1e12, the
        measure of Narayanan et al. 2021 Tables 1-2 and Dubey et al. 2024 Table 4.
    mfu: model_flops_per_iteration / step_time / n_gpus / peak_flops.
    bubble_fraction: :func:`pipeline_bubble`, idle time relative to the ideal
        compute ((pp - 1) / m under 1F1B).
    n_micro: micro-batches per replica per iteration (m).
    breakdown: the :class:`Breakdown`.
    """

    config: ParallelConfig
    memory_per_gpu_bytes: float
    fits: bool
    flops_per_iteration: int
    model_flops_per_iteration: int
    step_time_s: float
    tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    n_micro: int
    breakdown: Breakdown


def _check(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
           global_batch: int) -> int:
    """Validate the combination; return m, micro-batches per replica."""
    for name, value, cls in (("model", model, ModelSpec),
                             ("cluster", cluster, ClusterSpec),
                             ("config", config, ParallelConfig)):
        if not isinstance(value, cls):
            raise ValueError(f"{name}={value!r} must be a {cls.__name__}")
    if config.world_size != cluster.n_gpus:
        raise ValueError(f"config dp*cp*pp*tp={config.world_size} must equal "
                         f"cluster.n_gpus={cluster.n_gpus}")
    if model.n_heads % config.tp:
        raise ValueError(f"config.tp={config.tp} must divide "
                         f"n_heads={model.n_heads}")
    stages = config.pp * (2 if config.schedule == "zb-v" else 1)
    if stages > model.n_layers:
        raise ValueError(f"config.pp={config.pp} must be <= "
                         f"n_layers={model.n_layers}" + (
                             " / 2 (ZB-V: two stages a rank)"
                             if config.schedule == "zb-v" else ""))
    if model.seq_len % config.cp:
        raise ValueError(f"config.cp={config.cp} must divide "
                         f"seq_len={model.seq_len}")
    per_step = config.dp * config.micro_batch
    if (isinstance(global_batch, bool) or not isinstance(global_batch, int)
            or global_batch < 1 or global_batch % per_step):
        raise ValueError(f"global_batch={global_batch!r} must be a positive "
                         f"multiple of dp*micro_batch={per_step}")
    return global_batch // per_step


def _ring(op: str, nbytes: float, n: int, bw: float, cluster: ClusterSpec) -> float:
    if n == 1:
        return 0.0
    return collective_time("ring", op, nbytes, n, cluster.latency_s, 1.0 / bw)


def _communication(model: ModelSpec, cluster: ClusterSpec, c: ParallelConfig,
                   n_params: int, m: int) -> tuple[dict, dict]:
    """Seconds per iteration of the tp, cp, pp and dp traffic; and their links."""
    g = cluster.gpus_per_node
    spans = {"tp": c.tp, "cp": c.tp * c.cp, "pp": c.tp * c.cp * c.pp,
             "dp": c.world_size}
    # a group stays in a node when its span fits and nodes hold whole spans
    links = {k: "intra" if span <= g and g % span == 0 else "inter"
             for k, span in spans.items()}
    bw = {k: cluster.intra_node_bw if v == "intra" else cluster.inter_node_bw
          for k, v in links.items()}
    full = c.recompute == "full"
    layers = math.ceil(model.n_layers / c.pp) * m  # layer passes per iteration
    sbh2 = 2 * (model.seq_len // c.cp) * c.micro_batch * model.hidden  # bytes
    t = {"tp": (6 if full else 4) * layers * _ring("all_reduce", sbh2, c.tp,
                                                   bw["tp"], cluster)}
    kv = 2 * 2 * model.seq_len * c.micro_batch * model.kv_hidden / c.tp
    t["cp"] = layers * ((2 if full else 1) * _ring("all_gather", kv, c.cp,
                                                   bw["cp"], cluster)
                        + _ring("reduce_scatter", kv, c.cp, bw["cp"], cluster))
    send = sbh2 / (c.tp if c.sequence_parallel else 1)
    sends = 4 if c.schedule == "zb-v" else 2  # a V rank sends for two stages
    t["pp"] = 0.0 if c.pp == 1 else sends * m * (cluster.latency_s + send / bw["pp"])
    grads = 2 * -(-n_params // (c.tp * c.pp))  # 16-bit, this rank's share
    n_dp = c.dp * c.cp
    if c.zero_stage == 3:
        t["dp"] = m * (2 * _ring("all_gather", grads, n_dp, bw["dp"], cluster)
                       + _ring("reduce_scatter", grads, n_dp, bw["dp"], cluster))
    elif c.zero_stage in (1, 2):
        t["dp"] = (_ring("reduce_scatter", grads, n_dp, bw["dp"], cluster)
                   + _ring("all_gather", grads, n_dp, bw["dp"], cluster))
    else:
        t["dp"] = _ring("all_reduce", grads, n_dp, bw["dp"], cluster)
    used = {k: links[k] for k in ("tp", "cp", "pp", "dp")
            if {"tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": n_dp}[k] > 1}
    return t, used


#: DDP's (and DeepSpeed's) default bucket: the unit gradients travel in.
BUCKET_BYTES = 25 * 2**20


def _exposed_dp(model: ModelSpec, cluster: ClusterSpec, c: ParallelConfig,
                n_params: int, m: int, compute_s: float, bw: float) -> float:
    """Seconds of data-parallel traffic nothing hides, under Chapter 13's rules."""
    n_dp = c.dp * c.cp
    if n_dp == 1:
        return 0.0
    grads = 2 * -(-n_params // (c.tp * c.pp))  # 16-bit, this rank's share
    passes = 4 if c.recompute == "full" else 3  # forward + backward (+ recompute)
    per_mb = compute_s / m  # one micro-batch on this rank
    if c.zero_stage in (0, 1, 2):
        op = "all_reduce" if c.zero_stage == 0 else "reduce_scatter"
        k = max(1, math.ceil(grads / BUCKET_BYTES))
        backward = [per_mb * (passes - 1) / passes / k] * k
        comms = [Comm(_ring(op, grads / k, n_dp, bw, cluster), ready_after=i)
                 for i in range(k)]
        exposed = two_streams(backward, comms).exposed_s
        if c.zero_stage:
            exposed += _ring("all_gather", grads, n_dp, bw, cluster)
        return exposed
    layers = math.ceil(model.n_layers / c.pp)
    unit = grads / layers
    gather = _ring("all_gather", unit, n_dp, bw, cluster)
    scatter = _ring("reduce_scatter", unit, n_dp, bw, cluster)
    fwd = [per_mb / passes / layers] * layers
    bwd = [per_mb * (passes - 1) / passes / layers] * layers
    comms = [Comm(gather, u - 2 if u else -1, u) for u in range(layers)]
    for j in range(layers):  # backward chunk layers + j, gathered one ahead
        comms.append(Comm(gather, layers + j - 2, layers + j))
        if j:
            comms.append(Comm(scatter, layers + j - 1))
    comms.append(Comm(scatter, 2 * layers - 1))
    return m * two_streams(fwd + bwd, comms).exposed_s


def estimate(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
             global_batch: int, overlap: bool = False) -> Estimate:
    """Memory, step time and throughput of one configuration.

    Args:
        model: the :class:`ModelSpec`.
        cluster: the :class:`ClusterSpec`; its n_gpus must equal dp*cp*pp*tp.
        config: the :class:`ParallelConfig`.
        global_batch: sequences per iteration, a multiple of dp * micro_batch.
        overlap: price the data-parallel traffic by Chapter 13's overlap rules
            (what nothing hides) instead of in full.
    Returns:
        An :class:`Estimate`.

    Taught in: Chapter 11, a planner checked against published runs.
    """
    m = _check(model, cluster, config, global_batch)
    n_params = param_count(model)
    memory = memory_breakdown(model, config, n_params, m)
    flops = flops_per_iteration(model, global_batch, config.recompute)
    model_flops = flops_per_iteration(model, global_batch, "none")
    rate = cluster.n_gpus * cluster.peak_flops * cluster.compute_efficiency
    bubble = pipeline_bubble(config.schedule, config.pp, m)
    time_s = {"compute": flops / rate, "bubble": flops / rate * bubble}
    comm, links = _communication(model, cluster, config, n_params, m)
    if overlap:
        dp_bw = cluster.intra_node_bw if links.get("dp") == "intra" \
            else cluster.inter_node_bw
        comm["dp"] = _exposed_dp(model, cluster, config, n_params, m,
                                 time_s["compute"], dp_bw)
    time_s.update(comm)
    limit = cluster.memory_bytes - cluster.reserved_bytes
    step = sum(time_s.values())
    total_mem = sum(memory.values())
    return Estimate(
        config=config, memory_per_gpu_bytes=total_mem, fits=total_mem <= limit,
        flops_per_iteration=flops, model_flops_per_iteration=model_flops,
        step_time_s=step, tflops_per_gpu=flops / step / cluster.n_gpus / 1e12,
        mfu=model_flops / step / cluster.n_gpus / cluster.peak_flops,
        bubble_fraction=bubble, n_micro=m,
        breakdown=Breakdown(time_s, memory, links, limit))
