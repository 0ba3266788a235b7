"""The capstone script trains a Hugging Face Llama (``--model hf-llama``) like the GPT:
two ranks equal one process (the SGD proof of tests/test_train.py, with its derived
tolerance), DDP and FSDP2 crash and resume bit-exactly, bf16 and accumulation run,
and ``--init-from`` loads real weights from a local directory. Every 2-rank run is
in one launch (tests/test_train.py's rank function).

Nothing is downloaded: the model comes from a random-init ``LlamaConfig`` (vocab 128,
hidden 64, 2 layers, 4 heads), the checkpoint from ``save_pretrained`` in the test,
and the Hub is switched off for the test and its ranks. Skipped only where
``transformers`` (the ``.[hf]`` extra) is not installed; ``make test`` installs it.
"""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers", reason="needs the .[hf] extra (transformers)")
os.environ["HF_HUB_OFFLINE"] = "1"  # any Hub access fails, here and in the ranks

from dtlib.models import hf  # noqa: E402
from dtlib.runtime import launch  # noqa: E402
from dtlib.train.config import TrainConfig  # noqa: E402
from dtlib.train.loop import main  # noqa: E402
from dtlib.train.model import build_model, count_params  # noqa: E402
from dtlib.zero.flat_params import default_unit_modules  # noqa: E402
from test_train import (SGD, Everywhere, assert_equal_to_one_process,  # noqa: E402
                        loss_rtol, losses, one_process, rank_runs, sharded_start,
                        with_base)

STEPS = 6
HF = ["--model", "hf-llama", "--vocab-size", "128", "--hidden", "64",
      "--n-layers", "2", "--n-heads", "4", "--seq-len", "16"]
BASE = [*HF, "--steps", str(STEPS), "--save-every", "3", "--log-every", "3",
        "--micro-batch", "2", "--dataset-size", "128"]
# The longest sums whose order may differ (see tests/test_train.py's derivation): the
# SwiGLU's dot products (2 x hidden = 128 terms) and the token sums of the global
# batch (2 x 2 x 16 = 64 tokens).
TERMS = 128


def _copy_step3(src: str, dst: str) -> None:
    """A directory holding only ``src``'s step-3 checkpoint: a crash anywhere in
    4-5."""
    os.makedirs(dst)
    shutil.copytree(os.path.join(src, "step00000003"),
                    os.path.join(dst, "step00000003"))


@pytest.fixture(scope="module")
def one():
    """The one-process references, once each (2 micro-batches of 2; one of 4; bf16)."""
    torch.set_num_threads(1)
    return {"sgd": one_process(*BASE, *SGD, "--accum-steps", "2"),
            "sgd_big": one_process(*BASE, *SGD, "--micro-batch", "4"),
            "bf16_big": one_process(*BASE, *SGD, "--micro-batch", "4",
                                    "--precision", "bf16")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every 2-rank run, in one launch (transformers is imported once per rank).

    DDP: an uninterrupted run that saves at steps 3 and 6, then a run resumed from a
    directory holding only its step-3 file. FSDP2: a run stopped after step 4
    without a final save, then resumed. And the SGD proof on 2 ranks.
    """
    tmp = str(tmp_path_factory.mktemp("train_hf"))
    straight_ckpt, crashed = (os.path.join(tmp, n) for n in ("straight", "ddp"))
    fsdp = ["--strategy", "fsdp", "--ckpt-dir", os.path.join(tmp, "fsdp")]
    export = ["--export-hf", os.path.join(tmp, "export")]
    plan = [("straight", ["--ckpt-dir", straight_ckpt], False),
            functools.partial(_copy_step3, straight_ckpt, crashed),
            ("ddp_resume", ["--ckpt-dir", crashed], False),
            ("fsdp_crash", [*fsdp, "--stop-after", "4"], False),
            ("fsdp_resume", [*fsdp, *export], False),
            ("sgd", SGD, False),
            Everywhere("start_fsdp", sharded_start, ["--strategy", "fsdp"])]
    res = launch.spawn(rank_runs, 2, with_base(BASE, plan), stream=False,
                       timeout=900)[0]
    res["export"] = export[1]
    return res


def test_parameter_count_comes_from_the_model():
    cfg = TrainConfig(model="hf-llama", vocab_size=128, hidden=64, n_layers=2,
                      n_heads=4)
    model = build_model(cfg)
    # embed + untied head + 2 x (q, k, v, o; gate, up, down; 2 RMSNorms) + final norm
    expected = 2 * 128 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert count_params(cfg) == hf.n_params(model) == expected == 98_624
    assert type(model).__name__ == "LlamaForCausalLM"
    # FSDP2 (shard_fsdp2's default units) wraps each decoder layer, nothing else
    assert default_unit_modules(model) == list(hf.decoder_layers(model))


def test_meta_start_reproduces_the_seeded_llama():
    """One process: the Llama built on meta, to_empty-ed and initialised in place
    has build_hf_llama's parameters and rotary tables bit for bit; --init-from
    (from_pretrained) is still loaded whole."""
    from dtlib.train.model import init_model, starts_on_meta

    cfg = TrainConfig(model="hf-llama", vocab_size=128, hidden=64, n_layers=2,
                      n_heads=4, seed=5)
    assert starts_on_meta(cfg) and not starts_on_meta(TrainConfig(
        model="hf-llama", init_from="a-directory"))
    model = build_model(cfg, meta=True)
    model.to_empty(device="cpu")
    init_model(model, cfg)
    ref = build_model(cfg)
    for got, want in ((dict(model.named_parameters()), dict(ref.named_parameters())),
                      (dict(model.named_buffers()), dict(ref.named_buffers()))):
        assert sorted(got) == sorted(want)
        assert [k for k in want if not torch.equal(got[k], want[k])] == []


@pytest.mark.timeout(1200)
def test_sharded_llama_start_equals_the_whole_build(runs):
    """FSDP2 on 2 ranks: every full parameter equals the whole build's, and a rank
    holds at most its shard plus one decoder layer (or the root's embedding and
    head) of parameter storage during set-up (tests/test_train.py's measure)."""
    run = runs["start_fsdp"]
    assert run["same_names"] and run["unequal"] == [], run
    assert max(held for _, held in run["seen"]) <= run["shard"] + run["unit"], run
    assert dict(run["seen"])["applied"] == 0


@pytest.mark.timeout(1200)  # the fixture's launch runs inside the first test
def test_ddp_crash_and_resume_is_bit_exact(runs):
    resumed = runs["ddp_resume"]
    assert resumed["start_step"] == 3 and resumed["end_step"] == STEPS
    assert resumed["param_sha256"] == runs["straight"]["param_sha256"]
    assert resumed["final_loss"] == runs["straight"]["final_loss"]
    for step in ("4", "5", "6"):  # redone identically
        assert resumed["losses"][step] == runs["straight"]["losses"][step]


@pytest.mark.timeout(1200)
def test_two_ranks_equal_one_process(runs, one):
    assert_equal_to_one_process(runs["sgd"], one["sgd"], terms=TERMS)
    assert losses(runs["sgd"])[-1] < losses(runs["sgd"])[0]  # it learns


@pytest.mark.timeout(1200)
def test_fsdp_crash_and_resume(runs):
    crash, resumed = runs["fsdp_crash"], runs["fsdp_resume"]
    assert resumed["start_step"] == 3 and resumed["end_step"] == STEPS
    assert crash["losses"]["4"] == resumed["losses"]["4"]  # same shards, same step
    # FSDP2 and DDP start from the same weights: step 1's loss is the same sums
    # (AdamW has not acted yet: a one-step check).
    torch.testing.assert_close(crash["losses"]["1"], runs["straight"]["losses"]["1"],
                               rtol=loss_rtol(1, TERMS), atol=0)


@pytest.mark.timeout(1200)
def test_export_hf_writes_what_from_pretrained_loads(runs):
    """--export-hf after an FSDP2 run on 2 ranks: the shards gathered into one
    save_pretrained directory that transformers loads by itself, with the trained
    parameters bit for bit (the same digest as the run's)."""
    from transformers import AutoModelForCausalLM

    from dtlib.train.state import param_digest

    loaded = AutoModelForCausalLM.from_pretrained(runs["export"],
                                                  local_files_only=True)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert param_digest(loaded)[0] == runs["fsdp_resume"]["param_sha256"]


def test_accumulation_equals_the_large_micro_batch_and_bf16_is_close(one):
    assert_equal_to_one_process(one["sgd"], one["sgd_big"], terms=TERMS)
    bf16, big = one["bf16_big"]["final_loss"], one["sgd_big"]["final_loss"]
    # bf16 keeps 8 significant bits (u = 2**-9); a few roundings per step: < 2%.
    assert bf16 != big and abs(bf16 - big) < 0.02 * big


def test_init_from_loads_local_weights(tmp_path):
    saved = hf.build_hf_llama(hf.llama_config(vocab_size=128, hidden=64, n_layers=2,
                                              n_heads=4, seq_len=16), seed=123)
    saved.save_pretrained(tmp_path / "tiny")  # config.json + model.safetensors
    cfg = TrainConfig(model="hf-llama", init_from=str(tmp_path / "tiny"),
                      vocab_size=128)
    loaded = build_model(cfg).state_dict()
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
    random = build_model(TrainConfig(model="hf-llama", vocab_size=128))
    assert not torch.equal(random.state_dict()["lm_head.weight"],
                           loaded["lm_head.weight"])
    # the script trains from it; the same shape from --model-config starts elsewhere
    args = ["--steps", "3", "--warmup", "1", "--micro-batch", "2",
            "--dataset-size", "32", "--vocab-size", "128", "--seq-len", "16"]
    pretrained = main(["--model", "hf-llama", "--init-from", str(tmp_path / "tiny"),
                       *args])
    from_config = main(["--model", "hf-llama", "--model-config",
                        str(tmp_path / "tiny" / "config.json"), *args])
    assert pretrained != from_config and pretrained < 6


@pytest.mark.parametrize("argv, words", [
    (["--model", "llama"], ["model='llama'", "gpt", "hf-llama"]),
    (["--init-from", "x"], ["init_from='x'", "hf-llama"]),
    (["--model", "hf-llama", "--init-from", "x", "--model-config", "y"],
     ["model_config", "init_from"]),
    (["--model", "hf-llama", "--init-from", "/no/such/dir"], ["/no/such/dir"]),
    (["--model", "hf-llama", "--model-config", "/no/such.json"], ["/no/such.json"]),
])
def test_bad_model_flags_are_named(argv, words, capsys):
    # A value the config checks stops with argparse's one-line error (SystemExit 2);
    # a path checked when the model is built raises ValueError.
    with pytest.raises((ValueError, SystemExit)) as err:
        main(argv)
    text = str(err.value) + capsys.readouterr().err
    for word in words:
        assert word in text
