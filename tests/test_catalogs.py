"""The Chinese edition cannot drift from the English one.

Its prose is the gettext catalogs in ``locale/zh_CN``; these tests fail, naming the
message and the file, when an English sentence changed and its translation did not,
when a message is untranslated or fuzzy, when a translation drops, adds or changes a
role, a glue name, math, inline code, a link or a number, and when a glossary term is
translated another way. Each check is shown catching a planted defect.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import polib
import pytest

from dtlib.exercises import catalogs

ROOT = catalogs.ROOT
LANG_DIR = ROOT / "locale" / "zh_CN" / "LC_MESSAGES"


def _report(found, limit=40):
    lines = [str(p) for p in found[:limit]]
    more = f"\n... and {len(found) - limit} more" if len(found) > limit else ""
    return "\n".join(lines) + more


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    return catalogs.extract(ROOT, tmp_path_factory.mktemp("pot"))


def test_every_page_has_a_catalog_in_step_with_its_english(extracted):
    found = catalogs.out_of_step(extracted, LANG_DIR)
    assert not found, f"{len(found)} message(s) out of step:\n{_report(found)}"


def test_every_message_is_translated_keeping_what_must_pass_through():
    found = catalogs.problems()
    assert not found, f"{len(found)} problem(s):\n{_report(found)}"


def test_the_pending_list_names_only_pages_still_being_translated():
    assert not catalogs.pending_problems(), "\n".join(catalogs.pending_problems())


def test_a_pending_page_waits_for_its_last_messages_but_not_for_its_checks(tmp_path):
    base = tmp_path / "zh_CN" / "LC_MESSAGES" / "notebooks"
    base.mkdir(parents=True)
    po = polib.POFile()
    po.append(polib.POEntry(msgid="Memory, measured", msgstr=""))
    po.append(polib.POEntry(msgid="Chapter 3 needs `dist.all_reduce`.",
                            msgstr="第 3 章需要 all_reduce。"))  # code dropped
    po.save(str(base / "07_x.po"))
    listed = {"notebooks/07_x": "under way"}
    assert catalogs.docname(base / "07_x.po") == "notebooks/07_x"
    found = catalogs.problems([base / "07_x.po"], terms=[], waiting=listed)
    assert [p.msgid for p in found] == ["Chapter 3 needs `dist.all_reduce`."], found
    # unlisted, the untranslated message is a problem too
    assert len(catalogs.problems([base / "07_x.po"], terms=[])) == 2
    # a listed page with nothing left to translate must leave the list
    (tmp_path / "zh_CN" / "pending.txt").write_text(
        "".join(f"{k}  {v}\n" for k, v in listed.items()) + "book/nowhere  x\n")
    assert catalogs.pending_problems(locale=tmp_path) == [
        "book/nowhere: no such page has a catalog"]
    po[0].msgstr = "内存，测量"
    po.save(str(base / "07_x.po"))
    assert catalogs.pending_problems(locale=tmp_path)[0].startswith(
        "notebooks/07_x: every message is translated")


def test_an_english_edit_leaves_its_stale_translation_named(tmp_path):
    # a checkout with one sentence of Chapter 3 changed, extracted as `make po` does
    copy = tmp_path / "book"
    copy.mkdir()
    for name in ("_config.yml", "_toc.yml", "_ext", "_static", "book", "notebooks"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, copy / name)
    nb = copy / "notebooks" / "03_data_parallel.ipynb"
    text = nb.read_text(encoding="utf-8")
    old = "Each rank must see a different part of the data"
    assert old in text
    nb.write_text(text.replace(old, "Every rank must read its own part of the data"),
                  encoding="utf-8")
    pots = catalogs.extract(copy, tmp_path / "pot")
    found = catalogs.out_of_step(pots, LANG_DIR)
    pages = {p.po for p in found}
    assert pages == {"locale/zh_CN/LC_MESSAGES/notebooks/03_data_parallel.po"}, _report(found)
    new = [p for p in found if "new or changed" in p.what]
    gone = [p for p in found if "any more" in p.what]
    assert len(new) == 1 and new[0].msgid.startswith("Every rank must read")
    assert len(gone) == 1 and gone[0].msgid.startswith(old)


def _entry_with(needle: str) -> polib.POEntry:
    for po in catalogs.catalog_files():
        for e in polib.pofile(str(po)):
            if needle in e.msgid and e.msgstr and needle in e.msgstr:
                return e
    pytest.fail(f"no translated message keeps {needle!r}")


def test_a_translation_missing_a_glue_role_is_caught():
    e = _entry_with("{glue:text}`ch3_true_mean:.1f`")
    assert catalogs.entry_problems(e.msgid, e.msgstr) == []
    planted = e.msgstr.replace("{glue:text}`ch3_true_mean:.1f`", "4.5")
    found = catalogs.entry_problems(e.msgid, planted)
    assert any("drops ['{glue:text}`ch3_true_mean:.1f`']" in f for f in found), found


@pytest.mark.parametrize("kept, planted", [
    ("`drop_last=False`", "`drop_last=True`"),           # inline code changed
    ("$\\lceil 10/4 \\rceil = 3$", "$\\lceil 10/4 \\rceil$"),  # math changed
    ("{cite:p}`li2020pytorch`", "{cite:p}`li2020`"),      # citation key changed
])
def test_a_translation_that_changes_code_math_or_a_citation_is_caught(kept, planted):
    e = _entry_with(kept)
    found = catalogs.entry_problems(e.msgid, e.msgstr.replace(kept, planted))
    assert any("drops" in f and "adds" in f for f in found), found


def test_a_titled_role_keeps_its_target_and_may_translate_its_title():
    en = "It assumes {doc}`Chapter 2 <02_collectives>`."
    assert catalogs.entry_problems(en, "它假定读过 {doc}`第 2 章 <02_collectives>`。") == []
    found = catalogs.entry_problems(en, "它假定读过 {doc}`第 2 章 <03_data_parallel>`。")
    assert any("{doc}<02_collectives>" in f for f in found), found


def test_a_changed_number_is_caught():
    en = "With 10 samples and 4 ranks, 10 is not a multiple of 4."
    assert catalogs.entry_problems(en, "10 个样本、4 个 rank：10 不是 4 的倍数。") == []
    found = catalogs.entry_problems(en, "10 个样本、8 个 rank：10 不是 4 的倍数。")
    assert any(f.startswith("numbers differ") for f in found), found


def test_an_inconsistent_term_is_caught():
    terms = catalogs.glossary()
    e = next((e for po in catalogs.catalog_files() for e in polib.pofile(str(po))
              if "data parallel" in e.msgid.lower() and "数据并行" in e.msgstr), None)
    assert e is not None, "no translated message renders 'data parallel' as 数据并行"
    assert catalogs.entry_problems(e.msgid, e.msgstr, terms=terms) == []
    found = catalogs.entry_problems(e.msgid, e.msgstr.replace("数据并行", "数据平行"),
                                    terms=terms)
    assert any("'数据并行'" in f for f in found), found
    # a term that stays in English must stay: "rank" rendered as 进程 is caught
    en = "Each rank reads its own shard."
    assert catalogs.entry_problems(en, "每个 rank 读取自己的分片。", terms=terms) == []
    found = catalogs.entry_problems(en, "每个进程读取自己的分片。", terms=terms)
    assert any("'rank'" in f for f in found), found


def test_untranslated_and_fuzzy_messages_are_caught(tmp_path):
    po = polib.POFile()
    po.append(polib.POEntry(msgid="Memory, measured", msgstr=""))
    po.append(polib.POEntry(msgid="Communication per step", msgstr="每步的通信",
                            flags=["fuzzy"]))
    path = tmp_path / "planted.po"
    po.save(str(path))
    found = catalogs.problems([path], terms=[])
    assert [(p.msgid, p.what.split(":")[0]) for p in found] == [
        ("Memory, measured", "untranslated"), ("Communication per step", "fuzzy")]


def test_the_glossary_is_the_page_and_names_its_kept_terms():
    terms = {t.english: t.chinese for t in catalogs.glossary()}
    assert terms["data parallelism"] == "数据并行"
    assert terms["all-reduce"] == "all-reduce"  # stays in English
    assert all(terms.values())
    # the word forms the check treats as the term, and those it does not
    term = catalogs.Term("shard", "分片")
    assert term.required("each rank's shards") and term.required("sharding a model")
    assert not term.required("`shard` is a function") and not term.required("shardless")


# dtlib's own sentences: the checkers' feedback, the tool's notes (domain "dtlib")

DTLIB_PO = ROOT / "dtlib" / "locale" / "zh_CN" / "LC_MESSAGES" / "dtlib.po"


def _dtlib_messages() -> set[str]:
    from babel.messages.extract import extract_from_dir

    found = extract_from_dir(str(ROOT / "dtlib"), method_map=[("**.py", "python")],
                             keywords={"_": None, "N_": None, "ngettext": (1, 2)})
    return {m[2] if isinstance(m[2], str) else m[2][0] for m in found}


def test_every_dtlib_message_has_a_chinese_translation_with_its_fields():
    po = {e.msgid: e for e in polib.pofile(str(DTLIB_PO)) if not e.obsolete}
    marked = _dtlib_messages()
    missing = sorted(marked - set(po))
    assert not missing, (f"{len(missing)} message(s) marked with _() are not in "
                         f"{DTLIB_PO.relative_to(ROOT)} (run make po):\n  "
                         + "\n  ".join(missing))
    bad = []
    for msgid in sorted(marked):
        e = po[msgid]
        # a plural message (ngettext) has one form per plural of the language
        translations = list(e.msgstr_plural.values()) if e.msgid_plural else [e.msgstr]
        if not all(translations) or "fuzzy" in e.flags:
            bad.append(f"untranslated or fuzzy: {msgid!r}")
            continue
        for text in translations:
            if sorted(catalogs.fields(msgid)) != sorted(catalogs.fields(text)):
                bad.append(f"fields {catalogs.fields(msgid)} became "
                           f"{catalogs.fields(text)}: {msgid!r}")
            elif catalogs.tokens(msgid) != catalogs.tokens(text):
                bad.append(f"inline code changed: {msgid!r}")
    assert not bad, "\n".join(bad)


def test_a_translation_that_renames_a_field_is_caught():
    assert catalogs.fields("on {world_size} ranks {what} failed:") == [
        "{world_size}", "{what}"]
    assert catalogs.fields("在 {world_size} 个 rank 上，{what}出错：") == [
        "{world_size}", "{what}"]
    assert catalogs.fields("在 {world} 个 rank 上，{what}出错：") != catalogs.fields(
        "on {world_size} ranks {what} failed:")


@pytest.mark.parametrize("lang, verdict, hint", [
    ("en", "Not yet", "Hint"), ("zh_CN", "还不对", "提示")])
def test_feedback_speaks_the_copys_language(monkeypatch, lang, verdict, hint):
    from dtlib.exercises.feedback import WrongAnswer
    from dtlib.runtime import i18n

    monkeypatch.setenv(i18n.ENV, lang)
    exc = WrongAnswer("x", "y")
    exc.attempt = 2
    lines = exc._render_traceback_()
    assert verdict in lines[0] and hint in lines[1]


def test_the_capstones_errors_speak_the_learners_language(monkeypatch):
    from dtlib.runtime import i18n
    from dtlib.train.config import TrainConfig

    for lang, words in (("en", "must be finite and > 0"), ("zh_CN", "必须是有限值且 > 0")):
        monkeypatch.setenv(i18n.ENV, lang)
        with pytest.raises(ValueError) as info:
            TrainConfig(lr=-1.0)
        assert str(info.value) == f"lr=-1.0 {words}", str(info.value)


# The checkers' sentences: every one a learner can read goes through the catalog.
_FEEDBACK_CALLS = {"WrongAnswer", "passed", "ShortcutTaken", "check_close"}
_FEEDBACK_NAMES = {"hint", "where", "side", "why", "what"}


def _english_sentences(tree) -> list[int]:
    """Lines of sentences (two words or more) given to a checker's feedback (an
    argument of WrongAnswer, passed, check_close; a hint=/what= keyword; a `hint`,
    `where` or `side` variable; a problem appended or returned) not marked with
    _() or N_()."""
    import ast

    parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    found = []

    def visit(node):
        if isinstance(node, ast.BinOp):
            visit(node.left), visit(node.right)
        elif isinstance(node, ast.IfExp):
            visit(node.body), visit(node.orelse)
        elif isinstance(node, ast.Tuple):
            for e in node.elts:
                visit(e)
        elif isinstance(node, (ast.Constant, ast.JoinedStr)):
            text = (node.value if isinstance(node, ast.Constant) else "".join(
                v.value for v in node.values if isinstance(v, ast.Constant)))
            p = parent.get(node)
            if (isinstance(text, str) and len(re.findall(r"[A-Za-z]{2,} +[A-Za-z]{2,}",
                                                         text)) >= 1
                    and not (isinstance(p, ast.Call)
                             and getattr(p.func, "id", "") in ("_", "N_"))):
                found.append(node.lineno)

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in _FEEDBACK_CALLS:
                for a in node.args[:1] if name == "check_close" else node.args:
                    visit(a)
            if name == "append" and getattr(node.func.value, "id", "") in (
                    "problems", "out"):
                for a in node.args:
                    visit(a)
            for kw in node.keywords:
                if kw.arg in ("hint", "what"):
                    visit(kw.value)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id in _FEEDBACK_NAMES
                for t in node.targets):
            visit(node.value)
    return found


def test_every_checker_sentence_goes_through_the_catalog():
    import ast

    left = []
    for path in sorted((ROOT / "dtlib" / "exercises").glob("*.py")):
        if path.name in ("catalogs.py", "mutants.py", "strip.py", "grade.py"):
            continue  # tools for the book's authors and teachers, not feedback
        tree = ast.parse(path.read_text(encoding="utf-8"))
        left += [f"{path.relative_to(ROOT)}:{n}" for n in _english_sentences(tree)]
    assert not left, ("feedback in English only (wrap it in _() and translate it "
                      "in dtlib.po):\n  " + "\n  ".join(left))


def test_an_unmarked_sentence_is_caught():
    import ast

    tree = ast.parse('raise WrongAnswer(f"rank {r} sent too much", hint=_("look"))\n'
                     'passed(_("all {n} ranks agree").format(n=4))\n'
                     'where = "on the page\'s world"\n')
    assert sorted(_english_sentences(tree)) == [1, 3]


def test_dtlibs_catalog_compiles_a_percent_in_prose(tmp_path):
    # "{pct:g} % of the device" holds "% o", which a %-format check takes for a
    # placeholder; dtlib's messages are str.format ones and must still compile
    import gettext

    po = polib.pofile(str(ROOT / "dtlib/locale/zh_CN/LC_MESSAGES/dtlib.po"))
    tricky = [e for e in po if re.search(r"% [a-z]", e.msgid) and e.msgstr]
    assert tricky, "dtlib.po no longer has a message with '% <letter>': pick another"
    mo = catalogs.compile_mo(ROOT / "dtlib/locale/zh_CN/LC_MESSAGES/dtlib.po",
                             tmp_path / "zh_CN" / "LC_MESSAGES" / "dtlib.mo")
    t = gettext.translation("dtlib", str(tmp_path), languages=["zh_CN"])
    assert mo.is_file()
    for e in tricky:
        assert t.gettext(e.msgid) == e.msgstr
