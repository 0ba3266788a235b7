"""The capstone never loses a checkpoint: a resume that does not belong to the run in
``--ckpt-dir`` is refused before anything is loaded, naming each field that differs
with both values and its flag, and every file of the directory is byte-identical
afterwards; bad input stops in one line naming the flag.

Each case is one call of the script's ``main`` in this process (a world of one: the
identity check runs before any process group exists, so the world size does not
matter to it; the multi-rank resumes, switches of strategy included, are proven in
``test_train.py``). The directories are made once per module (DDP and FSDP2
checkpoints of steps 2 and 4 of a 6-step run, a run on a token file) and copied for
each case, which hashes every file of its copy before and after.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil

import pytest

from dtlib.train.config import CHOICES, ZERO_TURNS_OFF, build_parser
from dtlib.train.data import main as data_main
from dtlib.train.faults import retain
from dtlib.train.identity import IDENTITY, run_identity, step_dirs
from dtlib.train.job import lr_lambda
from dtlib.train.loop import main

STEPS = 6
BASE = ["--steps", str(STEPS), "--save-every", "2", "--micro-batch", "2",
        "--dataset-size", "64", "--log-every", "1"]
TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def run(*argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``python -m dtlib.train ARGV`` run here."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def hashes(root: str) -> dict[str, str]:
    """SHA-256 of every file under ``root``, by its path relative to ``root``."""
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def tokens(directory: str, text: str) -> str:
    """A token directory of ``text`` (the byte tokenizer)."""
    os.makedirs(directory, exist_ok=True)
    src = os.path.join(directory + "-src.txt")
    with open(src, "w") as f:
        f.write(text)
    with contextlib.redirect_stdout(io.StringIO()):
        data_main(["prepare", src, "--tokenizer", "bytes", "--out", directory])
    return directory


DATA = ["--vocab-size", "256", "--seq-len", "16", "--eval-fraction", "0.1"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The pristine directories: ``ddp`` and ``fsdp`` (checkpoints of steps 2 and
    4, stopped after 5 without a final save), ``data`` (a token file's run),
    the token directories ``tok_a`` and ``tok_b``, and the uninterrupted run's
    summary (``straight``)."""
    root = str(tmp_path_factory.mktemp("identity"))
    out = {"root": root, "tok_a": tokens(os.path.join(root, "tok_a"), TEXT),
           "tok_b": tokens(os.path.join(root, "tok_b"), TEXT[:-200] + "an end.")}
    for name, extra in (("ddp", []), ("fsdp", ["--strategy", "fsdp"]),
                        ("data", ["--data", out["tok_a"], *DATA])):
        out[name] = os.path.join(root, name)
        code, text, err = run(*BASE, *extra, "--ckpt-dir", out[name],
                              "--stop-after", "5")
        assert code == 0, text + err
        assert [os.path.basename(p) for p in step_dirs(out[name])] == \
            ["step00000004", "step00000002"], os.listdir(out[name])
    summary = os.path.join(root, "straight.json")
    code, text, err = run(*BASE, "--summary-json", summary)
    assert code == 0, err
    out["straight"] = json.load(open(summary))
    return out


@pytest.fixture
def copy_of(made, tmp_path):
    """``copy_of(name)``: a fresh copy of the pristine directory ``name``."""
    def make(name: str) -> str:
        dst = str(tmp_path / name)
        shutil.copytree(made[name], dst)
        return dst
    return make


# (case, directory, flags, words of the one error line): refused with exit status 2,
# every file of the directory byte-identical afterwards.
REFUSED = [
    ("hidden", "ddp", ["--hidden", "32"], ["--hidden 64", "--hidden 32"]),
    ("hidden", "fsdp", ["--hidden", "32"], ["--hidden 64", "--hidden 32"]),
    ("layers", "ddp", ["--n-layers", "3"], ["--n-layers 2", "--n-layers 3"]),
    ("layers", "fsdp", ["--n-layers", "3"], ["--n-layers 2", "--n-layers 3"]),
    ("vocab", "ddp", ["--vocab-size", "128"], ["--vocab-size 64", "--vocab-size 128"]),
    ("vocab", "fsdp", ["--vocab-size", "128"],
     ["--vocab-size 64", "--vocab-size 128"]),
    ("seq_len", "ddp", ["--seq-len", "16"], ["--seq-len 32", "--seq-len 16"]),
    ("seq_len", "fsdp", ["--seq-len", "16"], ["--seq-len 32", "--seq-len 16"]),
    ("data", "ddp", ["--dataset-size", "128"],
     ["--dataset-size 64", "--dataset-size 128"]),
    ("data", "fsdp", ["--dataset-size", "128"],
     ["--dataset-size 64", "--dataset-size 128"]),
    ("seed", "ddp", ["--seed", "1"], ["--seed 0", "--seed 1"]),
    ("optimizer", "fsdp", ["--optimizer", "sgd"],
     ["--optimizer adamw", "--optimizer sgd (momentum 0.9)"]),
    ("another run, --fresh", "ddp", ["--hidden", "32", "--fresh"],
     ["--hidden 64", "--hidden 32"]),
    ("another run, --keep-last", "fsdp", ["--hidden", "32", "--keep-last", "1"],
     ["--hidden 64", "--hidden 32"]),
    ("two fields", "ddp", ["--hidden", "32", "--n-heads", "2"],
     ["--hidden 64", "--hidden 32", "--n-heads 4", "--n-heads 2"]),
    ("lr", "ddp", ["--lr", "0.01"], ["--lr 0.003", "--lr 0.01",
                                     "--allow-change lr"]),
    ("global batch", "fsdp", ["--micro-batch", "4"],
     ["global batch of 2 sequences", "global batch of 4 sequences",
      "--allow-change global-batch"]),
    ("steps", "ddp", ["--steps", "8"], ["--steps 6", "--steps 8",
                                        "--allow-change steps"]),
    ("precision", "ddp", ["--precision", "bf16"],
     ["--precision fp32", "--precision bf16", "--allow-change precision"]),
    ("allowed the wrong one", "ddp", ["--lr", "0.01", "--allow-change", "steps"],
     ["--lr 0.003", "--lr 0.01", "--allow-change lr"]),
]


@pytest.mark.parametrize("case, source, flags, words", REFUSED,
                         ids=[f"{c[0]}-{c[1]}" for c in REFUSED])
def test_a_resume_of_another_run_is_refused_and_touches_nothing(
        case, source, flags, words, copy_of):
    ckpt = copy_of(source)
    before = hashes(ckpt)
    extra = ["--strategy", "fsdp"] if source == "fsdp" and "--strategy" not in flags \
        else []
    code, out, err = run(*BASE, *extra, *flags, "--ckpt-dir", ckpt)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m dtlib.train: error: "), err
    assert "Traceback" not in err and out == "", out
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "step00000004" in lines[0]  # the checkpoint that differs, named
    assert hashes(ckpt) == before


def test_data_seq_len_and_split_of_a_token_run_are_refused(made, copy_of):
    """Another token file (the issue's "sampler has n=21444, this job 238"),
    another --seq-len, another held-out fraction: each refused naming it."""
    ckpt = copy_of("data")
    before = hashes(ckpt)
    for flags, words in (
            (["--data", made["tok_b"], *DATA], ["--data of", "tokens.bin of"]),
            (["--data", made["tok_a"], *DATA, "--seq-len", "8"],
             ["--seq-len 16", "--seq-len 8"]),
            (["--data", made["tok_a"], *DATA, "--eval-fraction", "0.2"],
             ["--eval-fraction 0.1", "--eval-fraction 0.2"]),
            (["--data", made["tok_a"], *DATA[:-2]],  # the default eval fraction
             ["--eval-fraction 0.1", "--eval-fraction 0.05"])):
        code, _, err = run(*BASE, *flags, "--ckpt-dir", ckpt)
        assert code == 2, err
        for word in words:
            assert word in err, (word, err)
    assert hashes(ckpt) == before


def test_a_one_file_checkpoint_and_another_runs_log_are_refused(made, copy_of,
                                                                tmp_path):
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "step00000003.pt").write_bytes(b"a chapter 9 checkpoint")
    code, _, err = run(*BASE, "--ckpt-dir", str(legacy))
    assert code == 2 and "step00000003.pt is a one-file checkpoint" in err, err
    assert os.listdir(legacy) == ["step00000003.pt"]
    log = os.path.join(copy_of("ddp"), "train_log.jsonl")
    before = open(log, "rb").read()
    code, _, err = run(*BASE, "--hidden", "32", "--ckpt-dir", str(tmp_path / "new"),
                       "--log-file", log)
    assert code == 2 and "is the log of another run" in err and "--log-file" in err
    assert open(log, "rb").read() == before
    assert not (tmp_path / "new").exists()


def test_a_free_change_is_printed_once(copy_of):
    """World size, strategy, logging: not part of what the tensors are; a resume
    that changes them says so in one line."""
    ckpt = copy_of("ddp")
    code, out, err = run(*BASE, "--log-every", "3", "--eval-every", "2",
                         "--ckpt-dir", ckpt)
    assert code == 0, err
    said = [line for line in out.splitlines() if "not part of the run's identity" in
            line]
    assert len(said) == 1, out
    assert "--log-every 1 -> --log-every 3" in said[0]
    assert "--eval-every 0 -> --eval-every 2" in said[0]


def test_the_same_command_resumes_and_keeps_every_earlier_file(made, copy_of):
    ckpt = copy_of("ddp")
    before = hashes(ckpt)
    code, out, err = run(*BASE, "--ckpt-dir", ckpt)
    assert code == 0, err
    assert "resumed from" in out and "step00000004 (step 4)" in out, out
    after = hashes(ckpt)
    assert {k: after[k] for k in before if k != "train_log.jsonl"} == \
        {k: v for k, v in before.items() if k != "train_log.jsonl"}
    log_before = open(os.path.join(made["ddp"], "train_log.jsonl")).read()
    assert open(os.path.join(ckpt, "train_log.jsonl")).read().startswith(log_before)
    assert any(k.startswith("step00000006/") for k in after)


@pytest.mark.parametrize("source, to", [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_another_strategy_resumes_the_same_directory(source, to, copy_of):
    """One format for every strategy: the other strategy resumes (no "damaged"),
    says what changed, and writes beside the files it read, which stay as they
    were. (Equal to the uninterrupted run on 2 and 4 ranks: test_train.py.)"""
    ckpt = copy_of(source)
    before = hashes(ckpt)
    code, out, err = run(*BASE, "--strategy", to, "--ckpt-dir", ckpt)
    assert code == 0, err
    assert "damaged" not in out + err
    assert f"--strategy {source} -> --strategy {to}" in out, out
    assert "--log-every 1 -> --log-every 1" not in out  # only what differs
    after = hashes(ckpt)
    assert all(after[k] == v for k, v in before.items() if k != "train_log.jsonl")
    saved = json.load(open(os.path.join(ckpt, "step00000006", IDENTITY)))
    assert saved["strategy"] == to


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_a_damaged_newest_checkpoint_falls_back_to_the_same_runs_previous(
        made, copy_of):
    """Step 4's shard file truncated: the resume warns, continues from step 2,
    ends bit-identical to the uninterrupted run, and keeps the damaged directory
    (renamed when step 4 is saved again), every file of it as it was."""
    ckpt = copy_of("ddp")
    shard = sorted(n for n in os.listdir(os.path.join(ckpt, "step00000004"))
                   if n.endswith(".distcp"))[0]
    _truncate(os.path.join(ckpt, "step00000004", shard))
    damaged = hashes(os.path.join(ckpt, "step00000004"))
    summary = os.path.join(ckpt, "..", "summary.json")
    with pytest.warns(UserWarning, match="step00000004 is damaged.*same run"):
        code, out, err = run(*BASE, "--ckpt-dir", ckpt, "--summary-json", summary)
    assert code == 0, err
    got = json.load(open(summary))
    assert got["start_step"] == 2 and "fell back over 1 damaged" in out, out
    assert got["param_sha256"] == made["straight"]["param_sha256"]
    assert "kept the damaged step00000004 as step00000004.damaged-1" in out
    assert hashes(os.path.join(ckpt, "step00000004.damaged-1")) == damaged


def test_when_every_checkpoint_is_damaged_only_fresh_starts_over(copy_of):
    ckpt = copy_of("fsdp")
    for step in ("step00000002", "step00000004"):
        _truncate(os.path.join(ckpt, step, "rank0.pt"))
    before = hashes(ckpt)
    with pytest.warns(UserWarning, match="damaged"):
        code, out, err = run(*BASE, "--strategy", "fsdp", "--ckpt-dir", ckpt)
    assert code == 2, out + err
    assert "no checkpoint of" in err and "2 damaged" in err and "--fresh" in err
    assert hashes(ckpt) == before
    code, out, err = run(*BASE, "--strategy", "fsdp", "--ckpt-dir", ckpt, "--fresh")
    assert code == 0, err
    assert "superseded-1" in out, out
    moved = hashes(os.path.join(ckpt, "superseded-1"))
    assert moved == {k: v for k, v in before.items() if k.startswith("step")}
    assert [os.path.basename(p) for p in step_dirs(ckpt)] == \
        ["step00000006", "step00000004", "step00000002"]


def test_an_allowed_change_is_printed_and_applied(copy_of):
    """--allow-change lr,steps: the schedule of the new values from step 4 on
    (the optimizer's saved base learning rate replaced), printed at start-up."""
    ckpt = copy_of("ddp")
    code, out, err = run(*BASE[:1], "8", *BASE[2:], "--lr", "0.01", "--ckpt-dir", ckpt,
                         "--allow-change", "lr,steps")
    assert code == 0, err
    assert "changed with --allow-change: --lr 0.003 -> --lr 0.01" in out, out
    assert "changed with --allow-change: --steps 6 -> --steps 8" in out, out
    records = [json.loads(line) for line in open(os.path.join(ckpt,
                                                              "train_log.jsonl"))]
    lr5 = [r["lr"] for r in records if r.get("step") == 5][-1]  # logged after step 5
    assert lr5 == pytest.approx(0.01 * lr_lambda(5, 2, 8, 0.1), rel=1e-12)


def test_keep_last_deletes_only_this_runs_checkpoints(made, copy_of):
    from dtlib.train.config import parse_args

    ckpt = copy_of("ddp")
    foreign = os.path.join(ckpt, "step00000001")
    shutil.copytree(os.path.join(ckpt, "step00000002"), foreign)
    ident = json.load(open(os.path.join(foreign, IDENTITY)))
    json.dump({**ident, "hidden": 128}, open(os.path.join(foreign, IDENTITY), "w"))
    unreadable = os.path.join(ckpt, "step00000003")
    shutil.copytree(os.path.join(ckpt, "step00000002"), unreadable)
    os.remove(os.path.join(unreadable, IDENTITY))
    kept = {p: hashes(p) for p in (foreign, unreadable)}
    mine = run_identity(parse_args([*BASE]), 1)
    gone = retain(ckpt, 1, mine)
    assert [os.path.basename(p) for p in gone] == ["step00000002"]
    assert {p: hashes(p) for p in kept} == kept
    assert os.path.isdir(os.path.join(ckpt, "step00000004"))


# ---- bad input: one line naming the flag, nothing written ---------------------------

def test_bad_token_files_and_paths_stop_in_one_line(made, tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(made["tok_a"], missing)
    os.remove(missing / "tokens.bin")
    short = tmp_path / "short"
    shutil.copytree(made["tok_a"], short)
    _truncate(str(short / "tokens.bin"))
    (tmp_path / "a_file").write_text("x")
    for flags, words in (
            (["--data", str(missing), *DATA], ["--data", "has no tokens.bin"]),
            (["--data", str(short), *DATA], ["--data", "truncated", "bytes"]),
            (["--data", made["tok_a"], "--vocab-size", "256", "--seq-len", "5000"],
             ["--seq-len", "seq_len=5000", "longer than the token file"]),
            (["--ckpt-dir", "/proc/self/ckpt"], ["--ckpt-dir", "cannot be written"]),
            (["--ckpt-dir", str(tmp_path / "a_file" / "ckpt")],
             ["--ckpt-dir", "is a file"]),
            (["--allow-change", "hidden"], ["--allow-change", "global-batch"]),
            (["--warmup", "3", "--steps", "3"], ["--warmup", "warmup=3", "0 to 2"])):
        code, out, err = run(*flags)
        assert code == 2, (flags, out, err)
        last = err.strip().splitlines()[-1]
        assert "Traceback" not in err and "eval_fraction" not in last, err
        for word in words:
            assert word in last, (word, last)
    assert sorted(os.listdir(tmp_path)) == ["a_file", "missing", "short"]


@pytest.mark.parametrize("steps, warmup", [(1, 0), (2, 1), (3, 2)])
def test_one_or_two_steps_run_with_a_warmup_derived_from_steps(steps, warmup,
                                                               tmp_path):
    summary = str(tmp_path / "s.json")
    code, _, err = run("--steps", str(steps), "--micro-batch", "2", "--summary-json",
                       summary)
    assert code == 0, err
    assert json.load(open(summary))["config"]["warmup"] == warmup


def test_save_every_0_saves_only_the_last_step(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    code, _, err = run("--steps", "3", "--micro-batch", "2", "--save-every", "0",
                       "--log-every", "0", "--ckpt-dir", ckpt)
    assert code == 0, err
    assert [os.path.basename(p) for p in step_dirs(ckpt)] == ["step00000003"]


def test_help_shows_every_choice_and_each_default_once(monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # no line wrapping inside a phrase
    text = build_parser().format_help()
    flat = " ".join(text.split())
    for name, allowed in CHOICES.items():
        assert "{" + ",".join(allowed) + "}" in flat, name
    for action in build_parser()._actions:
        if action.help and action.dest != "help":
            assert action.help.count("default:") <= 1, action.dest
    assert "(default: 2, or steps - 1 when steps <= 2)" in flat
    assert " ".join(ZERO_TURNS_OFF.split()) in flat


def test_prepare_refuses_an_existing_token_file_without_force(made, tmp_path,
                                                              capsys):
    out = tmp_path / "tok"
    shutil.copytree(made["tok_a"], out)
    before = hashes(str(out))
    src = made["tok_a"] + "-src.txt"
    with pytest.raises(SystemExit) as stop:
        data_main(["prepare", src, "--tokenizer", "bytes", "--out", str(out)])
    assert stop.value.code == 2
    assert "--force" in capsys.readouterr().err
    assert hashes(str(out)) == before
    other = made["tok_b"] + "-src.txt"
    data_main(["prepare", other, "--tokenizer", "bytes", "--out", str(out),
               "--force"])
    assert hashes(str(out)) != before


@pytest.mark.timeout(600)
def test_the_issues_two_torchrun_commands_leave_the_first_runs_files(tmp_path):
    """The report this file answers: a 2-rank FSDP2 run of --hidden 64, then the same
    command with --hidden 32 over its directory. Every rank refuses before it
    builds anything (exit status 2; torchrun reports the failed workers); the
    message, printed once by rank 0, names --hidden and both values; every file
    of the first run is byte-identical."""
    import subprocess
    import sys

    def torchrun(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node=2", "--monitor_interval=0.1", "-m", "dtlib.train",
             "--strategy", "fsdp", *flags, "--steps", "10", "--save-every", "5",
             "--ckpt-dir", "run"], cwd=tmp_path, capture_output=True, text=True,
            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})

    first = torchrun("--hidden", "64")
    assert first.returncode == 0, first.stdout + first.stderr
    before = hashes(str(tmp_path / "run"))
    assert {k.split("/")[0] for k in before} == {"step00000005", "step00000010",
                                                 "train_log.jsonl"}
    second = torchrun("--hidden", "32")
    text = second.stdout + second.stderr
    assert second.returncode != 0, text
    assert "exitcode: 2" in text or "exit code: 2" in text.lower(), text
    said = [line for line in text.splitlines() if "dtlib.train: error:" in line]
    assert len(said) == 1, text
    assert "was written with --hidden 64; this run has --hidden 32" in said[0]
    assert "damaged" not in text and "starting from step 0" not in text
    assert hashes(str(tmp_path / "run")) == before
