"""The exercise machinery: learner copies that keep the learner's work, feedback that
teaches, and checkers that judge the property each exercise teaches."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtlib.exercises import WrongAnswer, check_close
from dtlib.exercises.hello import check_all_reduce_prediction
from dtlib.exercises.strip import strip_notebook, strip_source

SOLVED = """def f(x):
    ### BEGIN SOLUTION
    y = x * 2
    return y
    ### END SOLUTION

check(f)
"""


def test_strip_replaces_the_solution_at_its_indentation() -> None:
    assert strip_source(SOLVED) == (
        "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError\n\ncheck(f)\n")


@pytest.mark.parametrize("bad, message", [
    ("### BEGIN SOLUTION\nx = 1\n", "without"),
    ("x = 1\n### END SOLUTION\n", "without"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "nested"),
])
def test_strip_rejects_unbalanced_markers(bad: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        strip_source(bad)


def test_strip_command_writes_learner_notebooks(tmp_path) -> None:
    src = tmp_path / "nb"
    src.mkdir()
    nb = {"cells": [{"cell_type": "code", "source": SOLVED, "metadata": {},
                     "outputs": [{"output_type": "stream", "text": "x"}],
                     "execution_count": 3}], "metadata": {}, "nbformat": 4,
          "nbformat_minor": 5}
    (src / "ch.ipynb").write_text(json.dumps(nb))
    out = subprocess.run([sys.executable, "-m", "dtlib.exercises", "strip", str(src), "-o",
                          str(tmp_path / "ex")], capture_output=True, text=True, check=True)
    assert "ch.ipynb: 1 solution(s) removed" in out.stdout
    cell = json.loads((tmp_path / "ex" / "ch.ipynb").read_text())["cells"][0]
    assert "raise NotImplementedError" in cell["source"] and "x * 2" not in cell["source"]
    assert cell["outputs"] == [] and cell["execution_count"] is None


def _strip_cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "dtlib.exercises", "strip", *args],
                          capture_output=True, text=True, check=True).stdout


def test_strip_twice_keeps_the_learners_edit_and_force_overrides(tmp_path) -> None:
    src, dst = tmp_path / "nb", tmp_path / "ex"
    src.mkdir()
    nb = {"cells": [{"cell_type": "code", "source": SOLVED, "metadata": {},
                     "outputs": [], "execution_count": None}], "metadata": {},
          "nbformat": 4, "nbformat_minor": 5}
    (src / "a.ipynb").write_text(json.dumps(nb))
    (src / "b.ipynb").write_text(json.dumps(nb))
    _strip_cli(str(src), "-o", str(dst))
    mine = json.loads((dst / "a.ipynb").read_text())
    mine["cells"][0]["source"] = "def f(x):\n    return 2 * x  # my answer\n"
    (dst / "a.ipynb").write_text(json.dumps(mine))
    # The book changes; the learner's copy is kept, the untouched one is refreshed.
    nb["cells"][0]["source"] = SOLVED + "# new line from the book\n"
    (src / "a.ipynb").write_text(json.dumps(nb))
    (src / "b.ipynb").write_text(json.dumps(nb))
    out = _strip_cli(str(src), "-o", str(dst))
    assert "my answer" in (dst / "a.ipynb").read_text()
    assert "new line from the book" in (dst / "b.ipynb").read_text()
    assert "kept 1 notebook(s) you edited" in out and "a.ipynb" in out
    assert "--force" in out
    # A file the tool never wrote (no record) is not overwritten either.
    (dst / ".written.json").unlink()
    _strip_cli(str(src), "-o", str(dst))
    assert "my answer" in (dst / "a.ipynb").read_text()
    out = _strip_cli(str(src), "-o", str(dst), "--force")
    assert "my answer" not in (dst / "a.ipynb").read_text()
    assert "kept" not in out


def test_make_clean_leaves_exercises_alone() -> None:
    recipe = Path("Makefile").read_text().split("\nclean:")[1].split("\n\n")[0]
    assert "rm -rf _build" in recipe and "exercises" not in recipe


def _learner_copies(counts: bool = False) -> dict[str, Any]:
    """Every chapter's learner copy, as ``make exercises`` writes it (with the book's
    bibliography): name -> notebook, or (notebook, solutions removed)."""
    from dtlib.exercises.references import load
    from dtlib.exercises.strip import book_bibliography

    refs = load(book_bibliography("notebooks"))
    out = {p.name: strip_notebook(json.loads(p.read_text()), refs)
           for p in sorted(Path("notebooks").glob("*.ipynb"))}
    return out if counts else {k: v[0] for k, v in out.items()}


def test_every_book_notebook_strips_and_keeps_its_checkers() -> None:

    for name, (nb, count) in _learner_copies(counts=True).items():
        text = json.dumps(nb)
        assert "### BEGIN SOLUTION" not in text, name
        stubs = text.count("raise NotImplementedError") + text.count(" = ...\\n")
        assert stubs >= count, name


def test_no_learner_copy_keeps_a_solution_fence_or_an_empty_box() -> None:
    """A fence left in the next exercise's cell draws an empty exercise bar: every
    fence goes, wherever it stands, and a cell left empty goes with it."""

    for name, nb in _learner_copies().items():
        for i, cell in enumerate(nb["cells"]):
            src = "".join(cell["source"])
            assert "{solution-" not in src, f"{name} cell {i}"
            assert cell["cell_type"] != "markdown" or src.strip(), \
                f"{name} cell {i} is an empty markdown cell"
    # The case that used to slip through: a fence before the next exercise.
    cell = {"cell_type": "markdown", "metadata": {}, "source":
            "```{solution-end}\n```\n\n```{exercise} Next\n:label: ex-2\nText.\n```"}
    nb, _ = strip_notebook({"cells": [cell]})
    assert nb["cells"][0]["source"] == "```{exercise} Next\n:label: ex-2\nText.\n```"


def test_check_close_rejects_wrong_and_non_numbers() -> None:
    check_close("x", 2.0, 2.0)
    with pytest.raises(WrongAnswer, match="got 3.0, too large: expected a smaller "
                                          "value. Hint: h"):
        check_close("x", 3.0, 2.0, hint="h")
    with pytest.raises(WrongAnswer, match="expected a number"):
        check_close("x", "2", 2.0)


def test_all_reduce_checker_accepts_the_sum_and_rejects_the_own_value(capsys) -> None:
    check_all_reduce_prediction(lambda n, rank: n * (n + 1) / 2)
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="world_size=2, rank=0: you predicted 1"):
        check_all_reduce_prediction(lambda n, rank: rank + 1)


# ---- Chapter 2: the ring all-gather checker judges the ring, not only the result ----

RING_BATCHED = '''
def my_all_gather(tensor):
    """All-gather along dim 0 by a ring, with batch_isend_irecv."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = [torch.empty_like(tensor) for _ in range(n)]
    chunks[rank] = tensor.clone()
    for step in range(n - 1):
        send, recv = (rank - step) % n, (rank - step - 1) % n
        ops = [dist.P2POp(dist.isend, chunks[send], (rank + 1) % n),
               dist.P2POp(dist.irecv, chunks[recv], (rank - 1) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return torch.cat(chunks)
'''

DIRECT_EXCHANGE = '''
def my_all_gather(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = [torch.empty_like(tensor) for _ in range(n)]
    chunks[rank] = tensor.clone()
    works = []
    for peer in range(n):
        if peer != rank:
            works += [dist.isend(tensor, peer), dist.irecv(chunks[peer], peer)]
    for w in works:
        w.wait()
    return torch.cat(chunks)
'''

# n steps instead of n - 1: the last step passes on the rank's own shard again.
N_STEPS = RING_BATCHED.replace("range(n - 1)", "range(n)").replace(
    "chunks[recv]", "chunks[recv] if step < n - 1 else torch.empty_like(tensor)")


# The exercise fixes no direction: a ring turning left is a ring.
RING_LEFT = RING_BATCHED.replace(
    "send, recv = (rank - step) % n, (rank - step - 1) % n",
    "send, recv = (rank + step) % n, (rank + step + 1) % n").replace(
    "chunks[send], (rank + 1) % n", "chunks[send], (rank - 1) % n").replace(
    "chunks[recv], (rank - 1) % n", "chunks[recv], (rank + 1) % n")

# Each step's shard as two messages (one when the shard has one element).
RING_SPLIT = RING_BATCHED.replace(
    "        ops = [dist.P2POp(dist.isend, chunks[send], (rank + 1) % n),\n"
    "               dist.P2POp(dist.irecv, chunks[recv], (rank - 1) % n)]\n",
    "        half = max(1, (tensor.numel() + 1) // 2)\n"
    "        ops = [op for a, b in zip(chunks[send].view(-1).split(half),\n"
    "                                  chunks[recv].view(-1).split(half))\n"
    "               for op in (dist.P2POp(dist.isend, a, (rank + 1) % n),\n"
    "                          dist.P2POp(dist.irecv, b, (rank - 1) % n))]\n")

# Ring-shaped traffic of the right size as a decoy; the result rebuilt from what the
# inputs used to be (arange + 100 * rank) without the messages' contents.
REBUILT = '''
def my_all_gather(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(tensor)
    for _ in range(n - 1):
        for w in dist.batch_isend_irecv([
                dist.P2POp(dist.isend, tensor, (rank + 1) % n),
                dist.P2POp(dist.irecv, buf, (rank - 1) % n)]):
            w.wait()
    k = tensor.numel()
    return torch.cat([torch.arange(k, dtype=tensor.dtype).reshape(tensor.shape)
                      + 100 * r for r in range(n)])
'''


@pytest.mark.parametrize("source", [RING_BATCHED, RING_LEFT, RING_SPLIT],
                         ids=["right", "left", "split"])
def test_ring_checker_accepts_any_ring(source, capsys) -> None:
    from dtlib.exercises.collectives import check_ring_all_gather

    assert source is RING_BATCHED or source != RING_BATCHED  # the variant was made
    check_ring_all_gather(source, world_sizes=(2, 3))
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("source, message", [
    (DIRECT_EXCHANGE, "sends to ranks \\[1, 2\\]: in a ring, a rank sends only to one "
                      "neighbour"),
    (N_STEPS, "takes n - 1 = 2 steps"),
    (REBUILT, "expected"),
])
def test_ring_checker_rejects_what_is_not_a_ring(source: str, message: str) -> None:
    from dtlib.exercises.collectives import check_ring_all_gather

    with pytest.raises(WrongAnswer, match=message):
        check_ring_all_gather(source, world_sizes=(3,))


# ---- feedback: short, escalating, and "not attempted yet" for untouched stubs ----

def test_wrong_answer_renders_short_and_escalates_its_hint() -> None:
    from dtlib.exercises.memory import check_bytes_per_param

    shown = []
    for _ in range(2):
        with pytest.raises(WrongAnswer) as info:
            check_bytes_per_param(14)
        shown.append("\n".join(info.value._render_traceback_()))
    first, second = shown
    assert "Not yet" in first and "what does backward() write" in first
    # the checker named as code: its name spelled out in words would be English in a
    # Chinese copy's feedback
    assert "(check_bytes_per_param)" in first
    assert "Hint" not in first.replace("a hint comes", "")
    assert "Hint" in second and "'The corrected accounting'" in second
    for text in shown:  # no checker source, no traceback, no value to copy
        assert "Traceback" not in text and "def " not in text
        assert "16 " not in text and "16." not in text
        assert len(text.splitlines()) <= 3
    check_bytes_per_param(16)  # a success resets the escalation
    with pytest.raises(WrongAnswer) as info:
        check_bytes_per_param(20)
    assert info.value.attempt == 1 and "too large" in str(info.value)


def test_closed_form_feedback_never_shows_the_expected_value() -> None:
    from dtlib.exercises.memory import check_zero2_gb
    from dtlib.exercises.precision import check_format_constants

    for _ in range(3):
        with pytest.raises(WrongAnswer) as info:
            check_zero2_gb(7.5e9, 64, 20.0)
        assert "16.64" not in str(info.value)
        with pytest.raises(WrongAnswer) as info:  # eps one mantissa bit too fine
            check_format_constants(lambda e, m: (2.0 ** -(m + 1), 2.0 ** (2 - 2 ** (
                e - 1) - m), (2 - 2.0 ** -m) * 2.0 ** (2 ** (e - 1) - 1)))
        assert "0.0009765625" not in str(info.value) and "2**" not in str(info.value)


def _stub_predict(world_size: int, rank: int) -> float:
    """The value rank ``rank`` holds after the all-reduce."""
    # YOUR CODE HERE
    raise NotImplementedError


def test_untouched_exercises_are_not_attempted_and_start_nothing(monkeypatch,
                                                                 capsys) -> None:
    from dtlib.runtime import launch
    from dtlib.exercises.collectives import check_ring_all_gather
    from dtlib.exercises.hello import check_all_reduce_prediction
    from dtlib.exercises.memory import check_bytes_per_param

    def no_launch(*args, **kwargs):
        raise AssertionError("a checker started ranks for an untouched exercise")

    monkeypatch.setattr(launch, "spawn", no_launch)
    check_all_reduce_prediction(_stub_predict)
    check_bytes_per_param(...)
    check_ring_all_gather('def my_all_gather(tensor):\n    """Doc."""\n'
                          '    raise NotImplementedError\n')
    out = capsys.readouterr().out
    assert out.count("Not attempted yet") == 3 and "`_stub_predict`" in out
    assert "Correct" not in out


def test_strip_keeps_def_line_docstring_and_leaves_values_as_ellipsis() -> None:
    top_def = ('### BEGIN SOLUTION\ndef bubble(p, m):\n    """Idle fraction."""\n'
               '    return (p - 1) / (m + p - 1)\n### END SOLUTION\n\ncheck(bubble)\n')
    assert strip_source(top_def) == (
        'def bubble(p, m):\n    """Idle fraction."""\n    # YOUR CODE HERE\n'
        '    raise NotImplementedError\n\ncheck(bubble)\n')
    no_doc = ("### BEGIN SOLUTION\ndef predict(nbytes, n):\n    # 2 (n-1)/n: the answer\n"
              "    return 2\n### END SOLUTION\ncheck(predict)\n")
    assert "the answer" not in strip_source(no_doc)
    values = ("### BEGIN SOLUTION\nbias = 127\neps = 2.0 ** -7\ntiny = eps * 2.0 ** -bias\n"
              "### END SOLUTION\ncheck(eps, tiny)\n")
    assert strip_source(values) == (
        "# YOUR CODE HERE: replace each ... by your answer\neps = ...\ntiny = ...\n"
        "check(eps, tiny)\n")


# ---- Chapter 3: the bucket hook: tests/test_exercises_ch03_ch04.py ----


# ---- Chapter 4: bytes per stage, term by term ----

def _stage_bytes(n, stage, world_size, swap=False):
    shard = -(-n // world_size)
    p_at, g_at = (2, 3) if swap else (3, 2)
    return {"params": 2 * (shard if stage >= p_at else n),
            "grads": 2 * (shard if stage >= g_at else n),
            "optimizer": 12 * (shard if stage >= 1 else n)}


def test_stage_memory_checker_rejects_params_and_grads_swapped(capsys) -> None:
    from dtlib.exercises.zero import check_stage_memory

    check_stage_memory(_stage_bytes)
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="zero_stage=2.*the parameters.*should not "
                                          "be sharded"):
        check_stage_memory(lambda n, s, w: _stage_bytes(n, s, w, swap=True))
    with pytest.raises(WrongAnswer, match="return a dict"):
        check_stage_memory(lambda n, s, w: sum(_stage_bytes(n, s, w).values()))


# ---- Chapter 9: any atomic rename is accepted ----

def _save_with_rename(obj, path):
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # the permissions open() would give
    except BaseException:
        os.unlink(tmp)
        raise
    os.rename(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(dir_fd)  # the rename itself, on disk
    os.close(dir_fd)


def test_atomic_save_checker_accepts_os_rename(capsys) -> None:
    from dtlib.exercises.checkpoint import check_atomic_save

    check_atomic_save(_save_with_rename)
    assert "Correct" in capsys.readouterr().out


# ---- build-on-real-ranks exercises: right answers accepted, typical mistakes named ----

class _F(torch.autograd.Function):
    """f: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def _column_with_f(x, weight_shard, bias_shard):
    return torch.nn.functional.linear(_F.apply(x), weight_shard, bias_shard)


def _column_without_f(x, weight_shard, bias_shard):
    return torch.nn.functional.linear(x, weight_shard, bias_shard)


def test_column_parallel_checker(capsys) -> None:
    from dtlib.exercises.tensor_parallel import check_column_parallel
    from dtlib.exercises.tripwires import ShortcutTaken
    from dtlib.tensor_parallel.mappings import copy_to_tp

    check_column_parallel(_column_with_f)
    assert capsys.readouterr().out.count("Correct") == 1
    # the book's own f is what the exercise asks for: switched off while it runs
    with pytest.raises(ShortcutTaken, match="copy_to_tp"):
        check_column_parallel(
            lambda x, w, b: torch.nn.functional.linear(copy_to_tp(x), w, b),
            world_sizes=(2,))
    with pytest.raises(WrongAnswer, match="x.grad holds only this rank's share"):
        check_column_parallel(_column_without_f, world_sizes=(2,))


def _zero2_hook(param, name="reduce_scatter_single"):
    n = dist.get_world_size()
    flat = param.grad.reshape(-1)
    shard = torch.empty(flat.numel() // n, dtype=flat.dtype)
    # torch 2.13's name, else the older one (deprecated there, still accepted)
    (getattr(dist, name, None) or dist.reduce_scatter_tensor)(shard, flat)
    param.grad_shard = shard / n
    param.grad = None


def _zero2_hook_older_name(param):
    _zero2_hook(param, name="reduce_scatter_tensor")


def _all_reduce_hook(param):
    n, rank = dist.get_world_size(), dist.get_rank()
    flat = param.grad.reshape(-1) / n
    dist.all_reduce(flat)
    k = flat.numel() // n
    param.grad_shard = flat[rank * k:(rank + 1) * k]
    param.grad = None


def _summing_hook(param):
    flat = param.grad.reshape(-1)
    shard = torch.empty(flat.numel() // dist.get_world_size(), dtype=flat.dtype)
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
        shard, flat)
    param.grad_shard = shard
    param.grad = None


def test_zero2_hook_checker(capsys) -> None:
    from dtlib.exercises.zero import check_zero2_hook

    # 4 ranks with reduce_scatter_single (the list form: test_exercises_ch03_ch04.py);
    # the older name still computes the right shard, so it is accepted: the strict
    # deprecation rule is for dtlib's own code, not for the learner's answer
    check_zero2_hook(_zero2_hook, world_sizes=(4,))
    check_zero2_hook(_zero2_hook_older_name, world_sizes=(2,))
    assert capsys.readouterr().out.count("Correct") == 2
    with pytest.raises(WrongAnswer, match="calls \\['all_reduce'\\]"):
        check_zero2_hook(_all_reduce_hook, world_sizes=(2,))
    with pytest.raises(WrongAnswer, match="world_size times too large"):
        check_zero2_hook(_summing_hook, world_sizes=(2,))


def _gpipe_step(stage, micro_batches, targets, act_shape):
    if dist.get_rank() == 0:
        outs = []
        for x in micro_batches:
            y = stage(x)
            dist.send(y.detach(), dst=1)
            outs.append(y)
        for y in outs:
            grad = torch.empty_like(y)
            dist.recv(grad, src=1)
            y.backward(grad)
        return None
    inputs, losses = [], []
    for t in targets:
        a = torch.empty(act_shape)
        dist.recv(a, src=0)
        a.requires_grad_()
        inputs.append(a)
        losses.append(torch.nn.functional.mse_loss(stage(a), t) / len(targets))
    for a, loss in zip(inputs, losses):
        loss.backward()
        dist.send(a.grad, dst=0)
    return sum(loss.item() for loss in losses)


def _forward_only_step(stage, micro_batches, targets, act_shape):
    if dist.get_rank() == 0:
        for x in micro_batches:
            dist.send(stage(x).detach(), dst=1)
        return None
    total = 0.0
    for t in targets:
        a = torch.empty(act_shape)
        dist.recv(a, src=0)
        loss = torch.nn.functional.mse_loss(stage(a), t) / len(targets)
        loss.backward()
        total += loss.item()
    return total


def test_pipeline_step_checker(capsys) -> None:
    from dtlib.exercises.pipeline_parallel import check_pipeline_step

    check_pipeline_step(_gpipe_step)
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="the first stage \\(rank 0\\) has no gradient"):
        check_pipeline_step(_forward_only_step)


# ---- learner copies read well in JupyterLab: glued numbers from the learner's run ----

def test_learner_copy_turns_glue_roles_into_eval_of_the_learners_values() -> None:
    from dtlib.exercises import lab
    from dtlib.exercises.strip import GLUE_SETUP, glue_expression

    nb = {"cells": [
        {"cell_type": "markdown", "metadata": {}, "source": "# Title"},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": "from myst_nb import glue\nglue('ch9_x', 3.14159, display=False)"},
        {"cell_type": "markdown", "metadata": {},
         "source": "It took {glue:text}`ch9_x:.2f` s on {glue:text}`ch9_name`."},
        {"cell_type": "markdown", "metadata": {},
         "source": "```{solution-start} ch9-ex\n:class: dropdown\n```"},
        {"cell_type": "markdown", "metadata": {}, "source": "```{solution-end}\n```"},
    ], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    out, _ = strip_notebook(nb)
    sources = [c["source"] for c in out["cells"]]
    assert sources[1] == GLUE_SETUP  # before the notebook's own glue import
    x = glue_expression("ch9_x", ".2f", "run the cell above")
    name = glue_expression("ch9_name", "", "run the cells above")  # glued nowhere
    assert sources[3] == f"It took {{eval}}`{x}` s on {{eval}}`{name}`."
    assert len(sources) == 4  # the empty solution fences are gone
    # Saved with the copy: what jupyterlab-myst shows before any cell has run.
    saved = out["cells"][3]["metadata"]["user_expressions"]
    assert [(e["expression"], e["result"]["data"]["text/plain"]) for e in saved] == \
        [(x, "[run the cell above]"), (name, "[run the cells above]")]
    # What the kernel evaluates for those roles: in a kernel that has run nothing
    # (no set-up cell: no NameError), the same notes; then the learner's own values.
    lab.GLUED.clear()
    assert repr(eval(x, {})) == "[run the cell above]"  # noqa: S307
    exec(GLUE_SETUP, {})  # noqa: S102
    exec(sources[2], {})  # noqa: S102
    assert repr(eval(x, {})) == "3.14"  # noqa: S307
    # Plain text only, so that jupyterlab-myst sets it inline like a word (its
    # Markdown form would be a paragraph inside the sentence); glued Markdown keeps it.
    assert not hasattr(lab.glued("ch9_x", ".2f"), "_repr_markdown_")
    from IPython.display import Markdown

    lab.GLUED["ch9_table"] = Markdown("| a |\n|---|\n| 1 |")
    assert lab.glued("ch9_table")._repr_markdown_().startswith("| a |")


def test_a_numbers_note_names_the_cell_that_computes_it() -> None:
    from dtlib.exercises.strip import where_computed

    md = lambda s: {"cell_type": "markdown", "metadata": {}, "source": s}  # noqa: E731
    code = lambda s: {"cell_type": "code", "metadata": {}, "source": s}  # noqa: E731
    cells = [md("# Ch"), md("## The `ring` of $p$ ranks"), code('glue("a", 1)'),
             md("Uses {glue:text}`a`, {glue:text}`b_3`, {glue:text}`c`."),
             code('for k in (3, 4):\n    glue(f"b_{k}", k)'), md("## Later"),
             md("Uses {glue:text}`a` and {glue:text}`c`."), code("glue('c', 2)")]
    assert where_computed(cells, "a", 3) == "run the cell above"
    assert where_computed(cells, "b_3", 3) == "run the cell below"  # glued in a loop
    assert where_computed(cells, "a", 6) == "run “The ring of p ranks”"
    assert where_computed(cells, "c", 3) == "run “Later”"
    assert where_computed(cells, "c", 6) == "run the cell below"
    assert where_computed(cells, "nowhere", 6) == "run the cells above"


_EVAL = re.compile(r"\{eval\}`([^`]+)`")


def test_every_learner_copy_reads_before_and_after_the_set_up_cell() -> None:
    """As jupyterlab-myst shows a copy: on opening, each {eval} role reads as its saved
    result; after running the set-up cell only (or nothing), as what the kernel
    gives. Either way a short note naming a cell: never code, never an error."""
    from dtlib.exercises import lab
    from dtlib.exercises.strip import GLUE_SETUP

    notes = re.compile(r"\[run (the cells? (above|below)|“[^”]+”)\]")
    roles = 0
    for name, nb in _learner_copies().items():
        lab.GLUED.clear()
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "markdown":
                continue
            where = f"{name} cell {i}"
            exprs = _EVAL.findall(cell["source"])
            saved = {e["expression"]: e["result"]
                     for e in cell["metadata"].get("user_expressions", [])}
            assert set(exprs) == set(saved), where  # each role has its saved result
            for expr in exprs:
                roles += 1
                shown = saved[expr]["data"]["text/plain"]
                assert saved[expr]["status"] == "ok" and notes.fullmatch(shown), \
                    (where, shown)
                assert "glued(" not in shown and "Error" not in shown, where
                for setup in ((), (GLUE_SETUP,)):
                    ns: dict = {}
                    for code in setup:
                        exec(code, ns)  # noqa: S102
                    assert repr(eval(expr, ns)) == shown, where  # noqa: S307
    assert roles > 400  # every chapter's prose numbers were seen


def test_every_learner_copy_resolves_its_citations() -> None:
    """No citation role is left for jupyterlab-myst to draw as "Citation Not Found":
    each is author and year, linked to an entry of the copy's References cell, and
    the entry links to the paper."""
    link = re.compile(r"\]\(#(ref-[^)]+)\)")
    cited = 0
    for name, nb in _learner_copies().items():
        text = "\n".join(c["source"] for c in nb["cells"] if c["cell_type"] == "markdown")
        assert "{cite" not in text, name
        targets = set(re.findall(r"^\((ref-[^)]+)\)=$", text, re.M))
        used = set(link.findall(text))
        assert used == targets, (name, used ^ targets)
        cited += len(used)
        if used:
            assert nb["cells"][-1]["source"].startswith("## References"), name
    assert cited > 30


def test_citations_read_as_the_book_shows_them() -> None:
    from dtlib.exercises.references import Reference, readable_citations

    refs = {"a": Reference("a", "Rajbhandari et al.", "2020", "...", ""),
            "b": Reference("b", "Ren and He", "2021", "...", "")}
    assert readable_citations("see {cite:p}`a, b`.", refs) == \
        "see ([Rajbhandari et al., 2020](#ref-a); [Ren and He, 2021](#ref-b))."
    assert readable_citations("{cite:t}`a` wrote", refs) == \
        "[Rajbhandari et al. (2020)](#ref-a) wrote"
    assert readable_citations("{cite}`b`", refs) == "([Ren and He, 2021](#ref-b))"
    with pytest.raises(ValueError, match="no entry 'c' in the bibliography"):
        readable_citations("{cite:p}`c`", refs)
    cell = {"cell_type": "markdown", "metadata": {}, "source": "{cite:p}`a`"}
    with pytest.raises(ValueError, match="cites 'a': give refs"):
        strip_notebook({"cells": [cell]})


def test_bibliography_entries_name_authors_and_link_the_paper() -> None:
    from dtlib.exercises.references import load
    from dtlib.exercises.strip import book_bibliography

    refs = load(book_bibliography("notebooks"))
    zero = refs["rajbhandari2020zero"]
    assert (zero.authors, zero.year) == ("Rajbhandari et al.", "2020")
    assert zero.link == "https://doi.org/10.1109/SC41405.2020.00024"
    assert refs["goyal2017accurate"].text.startswith("Priya Goyal, Piotr Dollár")
    assert refs["shoeybi2019megatron"].link == "https://arxiv.org/abs/1909.08053"
    # Two NVIDIA pages of 2023 read apart, as author-year styles do.
    assert {refs["nccltests"].year, refs["nvidiah100"].year} == {"2023a", "2023b"}


def _global_scale(local_tokens):
    total = torch.tensor(float(sum(local_tokens)))
    dist.all_reduce(total)
    return dist.get_world_size() / total.item()


def _local_scale(local_tokens):
    return 1 / sum(local_tokens)


def test_loss_scale_on_ranks_checker(capsys) -> None:
    from dtlib.exercises.accumulation import check_loss_scale_on_ranks

    check_loss_scale_on_ranks(_global_scale)
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="rank 0, token counts \\[\\[30, 12, 50\\]"
                                          ", \\[41, 7, 20\\]\\]: you gave") as info:
        check_loss_scale_on_ranks(_local_scale, world_sizes=(2,))
    assert "dist.all_reduce" in info.value.hint


def _scaler_step(grads, scale, tracker, interval, agree=True, per_tensor=False):
    if per_tensor:  # a host read per tensor: bool() of each one's check
        found = torch.tensor([0.0 if all(torch.isfinite(g).all() for g in grads)
                              else 1.0])
    else:
        found = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
        found = found.float().reshape(1)
    if agree:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    for g in grads:
        g.div_(scale)
    if found.item():
        return True, scale * 0.5, 0
    tracker += 1
    if tracker == interval:
        return False, scale * 2.0, 0
    return False, scale, tracker


def _local_scaler_step(grads, scale, tracker, interval):
    return _scaler_step(grads, scale, tracker, interval, agree=False)


def _per_tensor_scaler_step(grads, scale, tracker, interval):
    return _scaler_step(grads, scale, tracker, interval, per_tensor=True)


def test_scaler_step_checker(capsys) -> None:
    from dtlib.exercises.precision import check_scaler_step

    check_scaler_step(_scaler_step)
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="step 2 .*the ranks disagree"):
        check_scaler_step(_local_scaler_step)
    # right numbers, but one host read per tensor where the exercise asks for one
    with pytest.raises(WrongAnswer, match=r"read tensors on the host 4 times in one "
                                          r"step \(bool\(\), bool\(\), bool\(\), "
                                          r"item\(\)\)"):
        check_scaler_step(_per_tensor_scaler_step)


def test_every_untouched_exercise_in_the_learner_copies_says_not_attempted(
        monkeypatch, capsys) -> None:
    """Run each stripped exercise cell as a learner would, untouched: every one says
    "not attempted yet", none raises, none starts a rank."""
    import linecache

    from dtlib.runtime import launch

    def no_launch(*args, **kwargs):
        raise AssertionError("a checker started ranks for an untouched exercise")

    monkeypatch.setattr(launch, "spawn", no_launch)
    checked = 0
    for name, nb in _learner_copies().items():
        namespace = {"torch": torch, "dist": dist}
        for k, cell in enumerate(nb["cells"]):
            src = cell["source"]
            stub = "raise NotImplementedError" in src or " = ...\n" in src
            if cell["cell_type"] != "code" or not stub or "check" not in src:
                continue
            # What IPython does for a cell: its text in linecache, so that
            # inspect.getsource (and so the stub detection) works.
            file = f"<{name[:-6]} cell {k}>"
            linecache.cache[file] = (len(src), None, src.splitlines(True), file)
            exec(compile(src, file, "exec"), namespace)  # noqa: S102
            out = capsys.readouterr().out
            assert "Not attempted yet" in out, (name, k, out)
            checked += 1
    assert checked >= 20


def _fsdp_blocks_then_root(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _fsdp_root_only(model):
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model)


def test_fsdp2_wrapping_checker(capsys) -> None:
    from dtlib.exercises.train import check_fsdp2_wrapping

    check_fsdp2_wrapping(_fsdp_blocks_then_root)
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="are not units of their own"):
        check_fsdp2_wrapping(_fsdp_root_only)
    with pytest.raises(WrongAnswer, match="the root was sharded before its blocks"):
        check_fsdp2_wrapping(_fsdp_root_first)
    with pytest.raises(WrongAnswer, match="keep their gathered parameters"):
        check_fsdp2_wrapping(_fsdp_kept_gathered)
    check_fsdp2_wrapping(_fsdp_explicit_default)  # reshard_after_forward=True, said
    assert "Correct" in capsys.readouterr().out


def _fsdp_kept_gathered(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, reshard_after_forward=False)
    return fully_shard(model)


def _fsdp_explicit_default(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True)
    return fully_shard(model, reshard_after_forward=True)


def _fsdp_root_first(model):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model)
    for block in model.blocks:
        fully_shard(block)
    return model
