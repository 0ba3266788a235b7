"""The capstone's real data and its log (dtlib.train.data, dtlib.train.tokens,
dtlib.train.metrics): token files hold exactly the text's tokens, the sampler's order
is the same for any world size and costs one permutation per epoch, and the README's
prepare-and-train example runs as written, under torchrun on 2 ranks, writing every
number a practitioner reads to its JSON-lines log.

One torchrun job (the README's); everything else runs in this process.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dtlib.train import data as train_data
from dtlib.train.config import parse_args
from dtlib.train.data import GlobalSampler, TokenWindows, held_out_split, step_batches
from dtlib.train.tokens import load_tokenizer, open_tokens, prepare, token_dtype

ROOT = Path(__file__).resolve().parents[1]
TEXT = "Ranks agree. Ünïcode bytes: ∑ 2 bytes, 3 bytes.\n"


# ---- token files ---------------------------------------------------------------------

def test_prepare_writes_the_texts_bytes_in_order(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("second\n", encoding="utf-8")
    meta = prepare([str(tmp_path / "a.txt"), str(tmp_path / "**" / "b.txt")],
                   load_tokenizer("bytes"), str(tmp_path / "out"))
    tokens, read = open_tokens(str(tmp_path / "out"))
    expected = (TEXT + "second\n").encode("utf-8")
    assert read == meta and meta["dtype"] == "uint16" and meta["vocab_size"] == 256
    assert meta["n_tokens"] == len(expected) and meta["documents"] == 2
    assert bytes(tokens.astype(np.uint8)) == expected
    assert isinstance(tokens, np.memmap)


def test_token_width_follows_the_vocabulary():
    assert token_dtype(256) == np.uint16 and token_dtype(2 ** 16) == np.uint16
    assert token_dtype(2 ** 16 + 1) == np.uint32  # Llama-3's 128,256 ids
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(0)


def test_a_hugging_face_tokenizer_directory(tmp_path):
    """A local tokenizer directory (a word-level one built here: nothing is
    downloaded): its ids, with its end-of-sequence id between documents."""
    pytest.importorskip("transformers", reason="needs the .[hf] extra")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, "ranks": 2, "agree": 3, "shards": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(tmp_path / "tok")
    for name, text in (("a", "ranks agree"), ("b", "shards agree")):
        (tmp_path / f"{name}.txt").write_text(text)
    meta = prepare([str(tmp_path / "?.txt")], load_tokenizer(str(tmp_path / "tok")),
                   str(tmp_path / "out"))
    tokens, _ = open_tokens(str(tmp_path / "out"))
    assert tokens.tolist() == [2, 3, 0, 4, 3] and meta["eos"] == 0


@pytest.mark.parametrize("call, words", [
    (lambda d: prepare([str(d / "none.txt")], load_tokenizer("bytes"), str(d)),
     ["none.txt", "does not exist"]),
    (lambda d: prepare([str(d / "*.md")], load_tokenizer("bytes"), str(d)),
     ["matches no file"]),
    (lambda d: load_tokenizer(str(d / "missing")), ["tokenizer=", "'bytes'"]),
    (lambda d: open_tokens(str(d)), ["meta.json", "prepare"]),
])
def test_bad_input_names_what_is_wrong(tmp_path, call, words):
    with pytest.raises(ValueError) as err:
        call(tmp_path)
    for word in words:
        assert word in str(err.value)


@pytest.fixture(scope="module")
def small_tokens(tmp_path_factory):
    """A token file of 1,000 byte tokens (ASCII: one byte, one token each)."""
    d = tmp_path_factory.mktemp("tokens")
    (d / "t.txt").write_bytes(bytes(32 + i % 95 for i in range(1000)))
    prepare([str(d / "t.txt")], load_tokenizer("bytes"), str(d / "out"))
    return str(d / "out")


def test_windows_tile_the_file_and_the_held_out_split_is_its_tail(small_tokens):
    tokens, _ = open_tokens(small_tokens)
    train, held = train_data.open_split(small_tokens, seq_len=16, eval_fraction=0.1)[:2]
    n = TokenWindows.count(1000, 16)  # (1000 - 1) // 16 = 62 windows
    assert (len(train), len(held)) == held_out_split(n, 0.1) == (n - 6, 6)
    rows = train.rows(torch.tensor([0, 3]))
    assert rows.dtype == torch.int64 and rows.shape == (2, 17)
    assert rows[1].tolist() == tokens[48:65].tolist()  # window 3: tokens 48..64
    assert held.rows(torch.tensor([0]))[0].tolist() == \
        tokens[(n - 6) * 16:(n - 6) * 16 + 17].tolist()


def test_flags_that_cannot_train_on_the_file_stop_in_one_line(small_tokens, capsys):
    for argv, words in ((["--data", small_tokens], ["--vocab-size", "256"]),
                        (["--data", small_tokens + "x"], ["--data", "not a directory"]),
                        (["--data", small_tokens, "--vocab-size", "256",
                          "--micro-batch", "64"], ["--data", "training windows"])):
        with pytest.raises(SystemExit):
            parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert all(w in err for w in words), err


# ---- the order -----------------------------------------------------------------------

def _global_steps(dp: int, accum: int, steps: int, n: int = 50, micro: int = 2,
                  seed: int = 3) -> list[list[set[int]]]:
    """Per step, the samples each of ``dp`` ranks reads (one sampler per rank, as
    every rank holds its own copy of the job's state)."""
    data = train_data.SyntheticTokens(n, 4, 16, seed=0)
    data.rows = lambda idx: idx[:, None].repeat(1, 5)  # a row is its sample index
    out = [[] for _ in range(steps)]
    for rank in range(dp):
        sampler = GlobalSampler(n, seed=seed)
        fn = step_batches(data, sampler, micro, accum, rank, dp, torch.device("cpu"))
        for s in range(steps):
            out[s].append({int(i) for x, _ in fn(s) for i in x[:, 0]})
        assert sampler.consumed == steps * micro * accum * dp  # any world size
    return out


def test_a_step_reads_the_same_samples_on_any_world_size():
    """1 x 4, 2 x 2 and 4 x 1 (dp x accumulation) of micro-batches of 2: every
    step's global batch is the same 8 samples; the ranks' shards are disjoint. 20
    steps of 8 cross two epochs of 50."""
    ref = [set().union(*step) for step in _global_steps(1, 4, 20)]
    for dp, accum in ((2, 2), (4, 1)):
        got = _global_steps(dp, accum, 20)
        for s, shards in enumerate(got):
            assert set().union(*shards) == ref[s], (dp, s)
            assert sum(map(len, shards)) == 8  # disjoint, 2 x accum each
    assert ref[0] != ref[1]


def test_the_order_is_a_seeded_permutation_per_epoch_computed_once(monkeypatch):
    calls = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    s = GlobalSampler(50, seed=7)
    first = [int(s.indices(torch.tensor([p]))) for p in range(150)]  # 3 epochs
    assert len(calls) == 3  # one permutation per epoch, not per micro-batch
    for e in range(3):
        assert sorted(first[50 * e:50 * e + 50]) == list(range(50))
    assert first[:50] != first[50:100]  # a new shuffle each epoch
    again = GlobalSampler(50, seed=7)
    again.load_state_dict(s.state_dict() | {"consumed": 0})
    assert again.indices(torch.arange(150)).tolist() == first
    assert GlobalSampler(50, seed=8).indices(torch.arange(50)).tolist() != first[:50]
    with pytest.raises(ValueError, match="seed"):
        GlobalSampler(50, seed=8).load_state_dict(s.state_dict())


# ---- the README's example, as written ------------------------------------------------

def readme_block(heading: str, index: int = 0) -> str:
    """The ``index``-th ```bash block under ``heading`` in README.md."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)[index]


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """The README's commands, run by bash in a directory that holds the repository's
    book/, dtlib/ and .venv (links), as a reader's checkout does."""
    cwd = tmp_path_factory.mktemp("readme")
    for name in ("book", "dtlib"):
        (cwd / name).symlink_to(ROOT / name)
    (cwd / ".venv").symlink_to(Path(sys.prefix))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the checkout's dtlib, found from the working dir
    done = subprocess.run(["bash", "-e", "-c", readme_block(
        "The capstone on your own text")], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return cwd, done.stdout


@pytest.mark.timeout(900)
def test_readme_prepares_the_books_text(readme_run):
    cwd, _ = readme_run
    files = sorted((ROOT / "book").glob("*.md")) + sorted(
        p for p in (ROOT / "dtlib").rglob("*.py"))
    meta = json.loads((cwd / "tokens" / "meta.json").read_text())
    assert meta["n_tokens"] == sum(len(p.read_bytes()) for p in files)
    assert meta["documents"] == len(files)
    tokens, _ = open_tokens(str(cwd / "tokens"))
    head = files[0].read_bytes()
    assert bytes(tokens[:len(head)].astype(np.uint8)) == head


@pytest.mark.timeout(900)
def test_readme_run_logs_what_a_practitioner_reads(readme_run):
    """Every logged step has every number, finite and in range; the held-out loss
    is logged at 20 and 40 and beats the uniform guess (ln 256)."""
    cwd, out = readme_run
    records = [r for r in map(json.loads, (cwd / "run" / "train_log.jsonl")
                              .read_text().splitlines()) if r.get("step", 99) <= 40]
    steps = [r for r in records if "loss" in r]
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert [r["step"] for r in steps] == [10, 20, 30, 40]
    tokens_per_step = 2 * 4 * 64  # dp 2 x micro-batch 4 x seq_len 64
    for r in steps:
        assert r["step_time_s"] > 0 and r["grad_norm"] > 0 and r["lr"] > 0
        assert r["tokens_per_s"] == pytest.approx(tokens_per_step / r["step_time_s"])
        assert 0 < r["mfu"] < 1 and r["peak_flops_source"].startswith("measured")
        assert r["peak_memory_bytes"] > 0 and r["peak_memory_kind"] == "peak RSS"
    assert set(evals) == {20, 40} and evals[40] < math.log(256)
    assert "MFU" in out and "peak RSS" in out and "eval loss" in out
    # The data position is global: after 40 steps of 8 samples, 320 on every rank.
    step40 = cwd / "run" / "step00000040"
    assert [torch.load(step40 / f"rank{r}.pt", weights_only=True)["sampler"]
            ["consumed"] for r in (0, 1)] == [320, 320]


@pytest.mark.timeout(900)
def test_readme_resumes_the_run_on_another_world_size(readme_run):
    """The README's second command, as written: the 2-rank run's step-40 checkpoint
    continued on one process with the same global batch (4 x 2 accumulated), the
    data position carried over (320 samples, then 8 more per step); the change of
    --steps is allowed by the command's --allow-change and printed."""
    cwd, _ = readme_run
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", "-e", "-c", readme_block(
        "The capstone on your own text", 1)], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "saved by 2 ranks, resumed on 1" in out and "(step 40)" in out, out
    assert "changed with --allow-change: --steps 40 -> --steps 44" in out, out
    step44 = cwd / "run" / "step00000044"
    assert json.loads((step44 / "manifest.json").read_text())["world_size"] == 1
    assert torch.load(step44 / "rank0.pt", weights_only=True)["sampler"][
        "consumed"] == 320 + 4 * 8


def test_mfu_counts_the_planners_matmuls_plus_six_flops_per_other_parameter():
    """6 N + 12 l s h per token is Chapter 11's matmul count (Narayanan et al.,
    recompute "none") plus 6 FLOPs for each parameter outside a matmul (GPT's
    13 l h biases and norms, s h learned positions): an exact integer identity,
    checked at GPT-2 small's shape."""
    from dtlib.memory.formulas import transformer_params
    from dtlib.planner.counts import flops_per_iteration
    from dtlib.planner.specs import ModelSpec
    from dtlib.train.metrics import flops_per_token

    l, h, a, v, s, batch = 12, 768, 12, 50304, 1024, 8
    n = transformer_params(l, h, v, s)
    planner = flops_per_iteration(ModelSpec(l, h, a, v, s), batch, "none")
    tokens = batch * s
    assert flops_per_token(n, l, s, h) * tokens - planner == 6 * tokens * (
        13 * l * h + s * h)
