"""The import rule of dtlib's layout (README, "Layout"), enforced by walking every import.

Layers, bottom to top:

    runtime                      the world and launching (dist never imports dtlib)
    models, technique packages   one per chapter topic, in the book's order
    chapters                     what each page runs, draws, reproduces from the seed
    exercises, bench             checking the learner; measuring

Rules:
1. A technique package (and ``models``) never imports the launcher side of the runtime
   (launch, supervise, worker, diagnose, magic), ``chapters``, ``exercises`` or
   ``bench``; it may import ``dtlib.runtime.dist``.
2. A technique package never imports a later chapter's technique.
3. ``runtime`` imports only ``runtime``; ``chapters`` never imports exercises or bench;
   a chapter's page code imports only earlier (or its own) chapters' page code.
4. matplotlib, IPython and ipywidgets are imported only in figure code
   (``chapters/*/figures.py``) and the notebook magic (``runtime/magic.py``).
5. No import cycle between modules (lazy imports inside functions count).
6. The capstone (``train``) sits above every technique it combines, ``parallel_nd``
   included.
7. One loop: outside ``dtlib.models.run.run_steps`` no function loops over a
   backward and an optimizer step (the seed's own loops stay in ``seed.py``).
8. No module imports another module's private (``_``-prefixed) name.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "dtlib"

#: Technique packages by the chapter that teaches them (models serve every chapter).
CHAPTER_OF = {
    "models": 0, "memory": 1, "collectives": 2, "data_parallel": 3, "zero": 4,
    "tensor_parallel": 5, "pipeline_parallel": 6, "precision": 7, "accumulation": 8,
    "checkpoint": 9, "parallel_nd": 11, "planner": 11, "context_parallel": 12,
    "expert_parallel": 14, "low_comm": 15,
    # The capstone is taught in Chapter 10 but combines every technique (Chapter 11's
    # FSDP x TP included): it sits above them all in the import order.
    "train": 100,
}
LAUNCHER = {"launch", "supervise", "worker", "diagnose", "magic"}
FIGURE_ONLY = ("matplotlib", "IPython", "ipywidgets")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, known: set[str]) -> str:
    """The longest known dtlib module that ``name`` starts with."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def import_edges(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> every module it imports (dtlib modules resolved; others top-level)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    known = set(files)
    edges: dict[str, set[str]] = {}
    for mod, path in files.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from dtlib.x import y` may name a submodule y
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            for t in targets:
                if t.split(".")[0] == "dtlib":
                    r = _resolve(t, known)
                    if r and r != mod:
                        out.add(r)
                else:
                    out.add(t.split(".")[0])
        edges[mod] = out
    return edges


def _parts(mod: str) -> list[str]:
    return mod.split(".")[1:]  # drop "dtlib"


def violations(root: Path = ROOT) -> list[str]:
    """Every broken rule, as "importer -> imported: why"."""
    edges = import_edges(root)
    found: list[str] = []
    for mod, targets in edges.items():
        p = _parts(mod)
        top = p[0] if p else ""
        for t in targets:
            if t in FIGURE_ONLY:
                if not (mod.endswith(".figures") or mod == "dtlib.runtime.magic"):
                    found.append(f"{mod} -> {t}: plotting/notebook code outside figures")
                continue
            if not t.startswith("dtlib."):
                continue
            q = _parts(t)
            ttop = q[0]
            if top in CHAPTER_OF:
                if ttop in ("chapters", "exercises", "bench"):
                    found.append(f"{mod} -> {t}: a technique imports {ttop}")
                elif ttop == "runtime" and q[1:2] and q[1] in LAUNCHER:
                    found.append(f"{mod} -> {t}: a technique imports the launcher")
                elif ttop in CHAPTER_OF and CHAPTER_OF[ttop] > CHAPTER_OF[top]:
                    found.append(f"{mod} -> {t}: chapter {CHAPTER_OF[top]} imports "
                                 f"a later chapter's technique ({CHAPTER_OF[ttop]})")
            elif top == "runtime" and ttop != "runtime":
                found.append(f"{mod} -> {t}: the runtime imports a layer above it")
            elif top == "chapters":
                if ttop in ("exercises", "bench"):
                    found.append(f"{mod} -> {t}: page code imports {ttop}")
                elif ttop == "chapters" and len(p) > 1 and len(q) > 1 \
                        and p[1].startswith("ch") and q[1].startswith("ch") \
                        and q[1] > p[1]:
                    found.append(f"{mod} -> {t}: page code imports a later chapter")
    found += [f"import cycle: {' -> '.join(c)}" for c in _cycles(edges)]
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One representative cycle per strongly connected set of dtlib modules."""
    graph = {m: {t for t in ts if t in edges} for m, ts in edges.items()}
    seen: set[str] = set()
    cycles = []

    def walk(node: str, stack: list[str], on_stack: set[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in on_stack:
                cyc = stack[stack.index(nxt):] + [nxt]
                if not seen.intersection(cyc):
                    cycles.append(cyc)
                    seen.update(cyc)
            elif nxt not in done:
                stack.append(nxt)
                on_stack.add(nxt)
                walk(nxt, stack, on_stack)
                on_stack.discard(stack.pop())
        done.add(node)

    done: set[str] = set()
    for m in sorted(graph):
        if m not in done:
            walk(m, [m], {m})
    return cycles


def test_dtlib_follows_the_import_rule() -> None:
    found = violations()
    assert not found, "import rule broken:\n" + "\n".join(found)


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "dtlib"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def test_rule_catches_a_technique_importing_page_code(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    with open(root / "zero" / "units.py", "a") as f:
        f.write("\n\ndef _bad():\n    from dtlib.chapters.tables import md_table\n")
    found = violations(root)
    assert any(v.startswith("dtlib.zero.units -> dtlib.chapters.tables") for v in found)


def test_rule_catches_a_later_chapter_and_plotting(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    with open(root / "collectives" / "algorithms.py", "a") as f:
        f.write("\nfrom dtlib.zero import optimizer\nimport matplotlib.pyplot\n")
    found = violations(root)
    assert any("dtlib.collectives.algorithms -> dtlib.zero.optimizer: chapter 2" in v
               for v in found)
    assert any("dtlib.collectives.algorithms -> matplotlib" in v for v in found)


def test_rule_catches_a_cycle(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    with open(root / "zero" / "units.py", "a") as f:
        f.write("\nfrom dtlib.zero import optimizer\n")
    assert any(v.startswith("import cycle") and "dtlib.zero.units" in v
               for v in violations(root))


def test_packages_state_their_public_api() -> None:
    for init in ROOT.glob("*/__init__.py"):
        text = init.read_text()
        assert ast.get_docstring(ast.parse(text)), f"{init} has no docstring"


#: Calls that run a backward pass inside a loop that also steps an optimizer.
BACKWARD_CALLS = {"backward", "accumulate_gradients", "forward_backward",
                  "pipeline_step", "step_fn"}
#: Text that marks an object whose own ``step`` runs forward and backward (a
#: ``torch.distributed.pipelining`` schedule) or whose ``backward`` and ``step`` train
#: (DeepSpeed's engine): a loop over such a ``step`` and an optimizer's ``step`` is a
#: training loop whatever the method names say.
TRAINER_MARKS = ("Schedule", "deepspeed", "initialize(")
#: Where a loop over backward and step is allowed: the loop itself, and the seed's
#: own loops reproduced as they were written (``chapters/*/seed.py``).
LOOP_HOME = "dtlib.models.run"


def _called(node: ast.AST) -> set[str]:
    names = set()
    for c in ast.walk(node):
        if isinstance(c, ast.Call):
            f = c.func
            names.add(f.attr if isinstance(f, ast.Attribute)
                      else f.id if isinstance(f, ast.Name) else "")
    return names


def _trainers(fn: ast.AST) -> set[str]:
    """Names bound in ``fn`` to a schedule or an engine, followed through the names
    they are built from (``classes = {...: ScheduleX}; cls = classes[k]; s = cls()``)."""
    bound: dict[str, str] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            text = ast.unparse(node.value)
            for target in node.targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name):
                        bound[t.id] = bound.get(t.id, "") + " " + text
    marked = {n for n, text in bound.items() if any(m in text for m in TRAINER_MARKS)}
    while True:
        more = {n for n, text in bound.items() if n not in marked
                and any(re.search(rf"\b{re.escape(m)}\b", text) for m in marked)}
        if not more:
            return marked
        marked |= more


def _step_receivers(loop: ast.AST) -> list[str]:
    return [ast.unparse(c.func.value) for c in ast.walk(loop)
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and c.func.attr == "step"]


def training_loops(root: Path = ROOT) -> list[str]:
    """Every function outside the one loop that loops over backward and step: by
    name (``backward``, ``forward_backward``, ...) or by what the object does (a
    pipelining schedule's ``step`` beside another ``step``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        mod = module_name(path, root)
        if mod == LOOP_HOME or mod.endswith(".seed"):
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            trainers = _trainers(fn)
            for loop in ast.walk(fn):
                if isinstance(loop, (ast.For, ast.While, ast.AsyncFor)):
                    calls = _called(loop)
                    steps = _step_receivers(loop)
                    by_schedule = any(r in trainers for r in steps) and len(steps) > 1
                    if by_schedule or "step" in calls and calls & BACKWARD_CALLS:
                        found.append(f"{mod}.{fn.name} (line {loop.lineno})")
                        break
    return found


#: How a page's rank entry's docstring begins: what each rank (or the lone
#: reference process) runs. bench and exercises launch these and nothing else of
#: a page: a constant, a class or a helper they need belongs in the package.
RANK_ENTRY = ("On every rank", "One rank", "One process")


def page_imports(root: Path = ROOT) -> list[str]:
    """Names bench and exercises import from page code that are not rank entries."""
    found = []
    for path in sorted(root.rglob("*.py")):
        mod = module_name(path, root)
        if _parts(mod)[:1] not in (["bench"], ["exercises"]):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith("dtlib.chapters.")):
                continue
            src = root.parent.joinpath(*node.module.split(".")).with_suffix(".py")
            defs = {d.name: d for d in ast.parse(src.read_text()).body
                    if isinstance(d, ast.FunctionDef)} if src.exists() else {}
            for a in node.names:
                fn = defs.get(a.name)
                if fn is None:
                    found.append(f"{mod} imports {node.module}.{a.name}: not a function "
                                 "defined there (a constant, class or re-export "
                                 "belongs in the package that page uses)")
                elif not (ast.get_docstring(fn) or "").startswith(RANK_ENTRY):
                    found.append(f"{mod} imports {node.module}.{a.name}: not a rank "
                                 f"entry (its docstring begins with none of "
                                 f"{RANK_ENTRY}); move what it does into the package")
    return found


def private_imports(root: Path = ROOT) -> list[str]:
    """``from dtlib.x import _y`` in a module other than ``dtlib.x``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        mod = module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.split(".")[0] == "dtlib":
                for a in node.names:
                    # `_` alone is gettext's public marker (dtlib.runtime.i18n._)
                    if a.name.startswith("_") and not a.name.startswith("__") \
                            and a.name != "_":
                        found.append(f"{mod} imports {node.module}.{a.name}")
    return found


def test_one_training_loop() -> None:
    found = training_loops()
    assert not found, ("loops over backward and optimizer step outside run_steps "
                       "(use dtlib.models.run.run_steps with a Parallelism):\n"
                       + "\n".join(found))


def test_one_loop_rule_catches_a_planted_loop(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    with open(root / "zero" / "units.py", "a") as f:
        f.write("\n\ndef train(model, opt, batches):\n"
                "    for x in batches:\n"
                "        model(x).sum().backward()\n"
                "        opt.step()\n")
    assert any(v.startswith("dtlib.zero.units.train") for v in training_loops(root))


def test_one_loop_rule_sees_a_schedule_stepping_beside_an_optimizer(tmp_path: Path
                                                                    ) -> None:
    """A pipelining schedule's ``step`` runs backward under another name (Chapter
    12's interleaved run was once such a loop); the rule follows the object."""
    root = _copy(tmp_path)
    with open(root / "zero" / "units.py", "a") as f:
        f.write("\n\ndef train(stages, opt, batches):\n"
                "    classes = {'i': ScheduleInterleaved1F1B}\n"
                "    cls = classes['i']\n"
                "    sched = cls(stages, 4)\n"
                "    for x in batches:\n"
                "        sched.step(x)\n"
                "        opt.step()\n"
                "\n\ndef lr_curve(opt, sched, n):\n"
                "    for _ in range(n):\n"
                "        opt.step()\n"
                "        sched.step()\n")
    found = training_loops(root)
    assert any(v.startswith("dtlib.zero.units.train ") for v in found)
    assert not any(v.startswith("dtlib.zero.units.lr_curve") for v in found)


def test_bench_and_exercises_use_only_a_pages_rank_entries() -> None:
    found = page_imports()
    assert not found, "\n".join(found)


def test_page_import_rule_catches_a_constant_and_a_helper(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    with open(root / "exercises" / "checkpoint.py", "a") as f:
        f.write("\nfrom dtlib.chapters.ch09_checkpointing.runs import seed_save_name\n"
                "from dtlib.chapters.ch09_checkpointing.runs import RUN_CFG\n"
                "from dtlib.chapters.ch09_checkpointing.runs import ddp_resume_proof\n")
    found = page_imports(root)
    assert any("seed_save_name: not a rank entry" in v for v in found)
    assert any("RUN_CFG: not a function defined there" in v for v in found)
    assert not any("ddp_resume_proof" in v for v in found)


def test_no_private_imports() -> None:
    found = private_imports()
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_private_import_rule_catches_a_planted_import(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    with open(root / "zero" / "units.py", "a") as f:
        f.write("\nfrom dtlib.zero.flat_params import _hidden\n")
    assert "dtlib.zero.units imports dtlib.zero.flat_params._hidden" \
        in private_imports(root)
