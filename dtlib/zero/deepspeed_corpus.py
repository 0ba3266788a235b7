"""A corpus of DeepSpeed configs that DeepSpeed's ``DeepSpeedConfig`` and
:func:`dtlib.zero.deepspeed_config.validate_deepspeed_config` both judge: valid ones,
typos, batch mismatches, removed features, offload at each stage.

``tests/test_deepspeed_config.py`` checks that the two agree on each; Chapter 4 quotes
its size.

Taught in: Chapter 4, "The seed's DeepSpeed config".
"""

from __future__ import annotations

from typing import Any

__all__ = ["CORPUS"]

B = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}  # 8 ranks, accum 1
SEED = {"train_batch_size": 256, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": 0.01}},
        "fp16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"}}}


def _zero(stage: int, **kw: Any) -> dict:
    return {**B, "zero_optimization": {"stage": stage, **kw}}


#: (name, config, world size, our verdict: True = valid)
CORPUS: list[tuple[str, dict, int, bool]] = [
    # valid
    ("batch only", {"train_batch_size": 32}, 8, True),
    ("micro only", {"train_micro_batch_size_per_gpu": 4}, 8, True),
    ("batch and accum", {"train_batch_size": 64, "gradient_accumulation_steps": 2},
     8, True),
    ("batch and micro", {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4},
     8, True),
    ("all three", {**B, "train_batch_size": 64, "gradient_accumulation_steps": 2},
     8, True),
    ("the seed, 8 ranks", SEED, 8, True),
    ("bf16", {**B, "bf16": {"enabled": True}}, 8, True),
    ("bfloat16 alias", {**B, "bfloat16": {"enabled": True}}, 8, True),
    ("fp16 dynamic", {**B, "fp16": {"enabled": True, "loss_scale": 0,
                                    "initial_scale_power": 16}}, 8, True),
    ("stage 0", _zero(0), 8, True),
    ("stage 1", _zero(1), 8, True),
    ("stage 2 tuned", _zero(2, overlap_comm=True, contiguous_gradients=True,
                             reduce_bucket_size=50_000_000,
                             allgather_bucket_size=50_000_000), 8, True),
    ("stage 3 tuned", _zero(3, stage3_prefetch_bucket_size=1000,
                             stage3_param_persistence_threshold=100,
                             stage3_gather_16bit_weights_on_model_save=True), 8, True),
    ("stage 3 short names", _zero(3, prefetch_bucket_size=1000,
                                   max_live_parameters=10 ** 8), 8, True),
    ("offload optimizer, stage 1", _zero(1, offload_optimizer={"device": "cpu"}),
     8, True),
    ("offload optimizer, stage 2", _zero(2, offload_optimizer={
        "device": "cpu", "pin_memory": True}), 8, True),
    ("offload optimizer, stage 3", _zero(3, offload_optimizer={"device": "cpu"}),
     8, True),
    ("offload param, stage 3", _zero(3, offload_param={"device": "cpu",
                                                        "pin_memory": True}), 8, True),
    ("offload to nvme", _zero(3, offload_param={"device": "nvme",
                                                 "nvme_path": "/local_nvme"}), 8, True),
    ("offload device none", _zero(1, offload_optimizer={"device": "none"}), 8, True),
    ("stage-3 key at stage 2", _zero(2, stage3_max_live_parameters=10 ** 8), 8, True),
    ("deprecated cpu_offload", _zero(2, cpu_offload=True), 8, True),
    ("optimizer and scheduler", {**B, "optimizer": {"type": "AdamW", "params": {
        "lr": 1e-4}}, "scheduler": {"type": "WarmupLR", "params": {
            "warmup_num_steps": 10}}}, 8, True),
    ("logging", {**B, "steps_per_print": 10, "wall_clock_breakdown": False,
                 "gradient_clipping": 1.0}, 8, True),
    ("activation checkpointing", {**B, "activation_checkpointing": {
        "partition_activations": True}}, 8, True),
    ("torch autocast", {**B, "torch_autocast": {"enabled": True}}, 8, True),
    ("communication dtype", {**B, "communication_data_type": "fp32"}, 8, True),
    ("untested optimizer", {**B, "zero_allow_untested_optimizer": True}, 8, True),
    # batch mismatches
    ("three disagree", {**B, "gradient_accumulation_steps": 2}, 8, False),
    ("the seed, 6 ranks", SEED, 6, False),
    ("batch not divisible by micro x ranks", {"train_batch_size": 36,
                                              "train_micro_batch_size_per_gpu": 4},
     8, False),
    ("no batch size", {"gradient_accumulation_steps": 2}, 8, False),
    ("negative micro", {"train_micro_batch_size_per_gpu": -4}, 8, False),
    ("zero batch", {"train_batch_size": 0}, 8, False),
    # precision and stage
    ("fp16 and bf16", {**B, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
     8, False),
    ("stage 4", _zero(4), 8, False),
    # typos
    ("typo at top level", {**B, "gradient_clip": 1.0}, 8, False),
    ("typo: accumulation", {"train_micro_batch_size_per_gpu": 4,
                            "gradient_acumulation_steps": 2}, 8, False),
    ("typo in zero", _zero(2, overlap_com=True), 8, False),
    ("typo in offload", _zero(3, offload_param={"device": "cpu",
                                                 "pin_memroy": True}), 8, False),
    # removed features
    ("amp", {**B, "amp": {"enabled": True}}, 8, False),
    ("mics_shard_size", _zero(3, mics_shard_size=2), 8, False),
    ("elasticity", {**B, "elasticity": {"enabled": True}}, 8, False),
    ("sparse_gradients", {**B, "sparse_gradients": True}, 8, False),
    # offload at the wrong stage or to the wrong place
    ("offload param, stage 2", _zero(2, offload_param={"device": "cpu"}), 8, False),
    ("offload optimizer, stage 0", _zero(0, offload_optimizer={"device": "cpu"}),
     8, False),
    ("offload to gpu", _zero(3, offload_param={"device": "gpu"}), 8, False),
    ("nvme without path", _zero(3, offload_optimizer={"device": "nvme"}), 8, False),
]

