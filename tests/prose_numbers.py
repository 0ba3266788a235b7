"""Find the numbers a chapter's prose states without computing them.

The book promises that every number in its prose comes from executed code. A number
in a markdown cell is accounted for when it is

- glued (``{glue:text}`name```), so the executed notebook supplies it;
- inside code (`` `...` ``), math (``$...$``), a role or a link target: there it is
  the name of something (``all_gather_single``, ``$2(N-1)/N$``, ``{doc}`02_...```);
- part of a name: a format, a model, a technique, an index (``fp32``, ``E4M3``,
  ``1F1B``, ``Llama-2 13B``, ``ZeRO-3``, ``Chapter 4``, ``rank 0``, ``stage 2``,
  ``ERRATA 9``, a year in a citation);
- or a phrase in the chapter's allow-list (``tests/prose_numbers/<notebook>.txt``),
  one per line as ``phrase  # why``: a value the next cell sets (``4 ranks``), a
  definition, or a published figure with its citation beside it.

Every other digit-bearing phrase is a claim typed by hand, and
``tests/test_prose_numbers.py`` fails on it, naming the notebook, the phrase and its
sentence.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ALLOW_DIR = os.path.join(HERE, "prose_numbers")

# Spans whose digits are names, not claims: fenced code, inline code, display and
# inline math, MyST roles with their argument, link targets, HTML comments, directive
# option lines (":width: 80%") and labels ("(ch3-label)=").
_SPANS = [
    r"```.*?```", r"~~~.*?~~~", r"\$\$.*?\$\$", r"(?<!\\)\$[^$]+?(?<!\\)\$",
    r"\{[a-z:\-]+\}`[^`]*`", r"`[^`]*`", r"\]\([^)]*\)", r"<!--.*?-->",
    r"^:[a-z\-]+:[^\n]*$", r"^\([^)]*\)=\s*$", r"<[^>\n]+>",
]
_SPAN_RE = re.compile("|".join(f"(?:{s})" for s in _SPANS), re.S | re.M)

# A number: digits with an optional decimal part, exponent, thousands separators,
# and a sign. A word that mixes letters and digits (fp32, 1F1B, H100, 2D) is a name.
_NUMBER = re.compile(
    r"(?<![\w.\-])[-+−]?\d[\d,]*(?:\.\d+)?(?:[eE][-+−]?\d+)?(?:\s*[×x]\s*10\^?[-−]?\d+)?"
    r"(?:[x×](?!\w))?(?![\w])")
# What comes right before a number and makes it an index or a name.
_NAME_BEFORE = re.compile(
    r"(?<![\w\-])(?:chapter|chapters|ch|§|section|sections|table|tables|figure|fig\.|eq\.|"
    r"equation|errata|erratum|rank|ranks|stage|stages|step|steps|line|lines|cell|"
    r"issue|version|torch|pytorch|python|deepspeed|transformers|nccl|cuda|sm|"
    r"zero-|zero|stage-|llama-|llama|gpt-|gpt|mistral|qwen|layer|block|device|"
    r"gpu|node|unit|units|micro-batch|bucket|no\.|part|level|dim|dimension|"
    r"phase|round|epoch|algorithm|listing|appendix|item|defect|mistake|exercise)"
    r"\s*[-–]?\s*$", re.I)
_YEAR = re.compile(r"^(19|20)\d\d$")
_NAME_AFTER = re.compile(
    r"^(?:\s*(?:st|nd|rd|th)\b|[.,]\w|-(?:bit|byte|way|D|d|rank|node|GPU|layer|step|"
    r"stage|block|token|element)s?\b"
    r"|\s*minutes to read)")  # a reading-time estimate, not a measurement
# A count of ranks (or GPUs, nodes) is the world a cell sets up, not a result.
_WORLD_AFTER = re.compile(r"^\s*(?:ranks?|processes|GPUs?|nodes?|devices|cores)\b")

# Numbers in words: a number word before a unit of measure ("a few hundred bytes",
# "eight times more precise", "a minute and a half"), and the fractions and multiples
# that state a ratio ("twice the", "a quarter of", "half the").
_WORDS = ("one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|"
          "fourteen|fifteen|sixteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|"
          "ninety|hundred|thousand|million|billion|a few|several|a dozen|dozens of|"
          "a minute|an hour|half an hour")
_UNITS = (r"bytes?|kilobytes|megabytes|gigabytes|[KMGT]i?B|ms|milliseconds|"
          r"microseconds|seconds?|minutes?|hours?|times|percent|per ?cent|parameters|"
          r"FLOPs|elements|and a half")
_NUMBER_WORDS = re.compile(
    rf"(?<![\w\-])(?:{_WORDS})(?:[- ](?:{_WORDS}))*\s+(?:{_UNITS})\b"
    r"(?!\s+to read)", re.I)
_RATIO_WORDS = re.compile(
    r"(?<![\w\-])(?:twice|thrice|half|a quarter|a third|double|triple)\s+"
    r"(?:as|the|of|more|less|its|their)\b", re.I)
# Inside math, a value computed from other symbols ("$4h = 128$", "$\approx 7 \times
# 10^{-4}$"); a definition of one symbol ("$h = 64$", "$N_d = 64$") is a setting.
_MATH = re.compile(r"(?<!\\)\$\$?([^$]+?)(?<!\\)\$\$?")
_MATH_VALUE = re.compile(
    r"(?:^|[,;(]|\\quad|\\text\{[^}]*\})\s*([^=,;(]*?)\s*(=|\\approx|\\sim|\\le|"
    r"\\ge|<|>)\s*([-−]?\d[\d.,]*(?:\s*\\times\s*10\^\{?[-−]?\d+\}?)?)(?![\w{^\\])")
_SYMBOL = re.compile(r"^\\?[A-Za-z]+(?:_\{?[\w,]+\}?)?$")
# "a 10M-parameter model": a size written as a name, still a claim.
_SIZE_NAME = re.compile(r"(?<![\w.])\d+(?:\.\d+)?[KMBT]-?param(?:eter)?s?\b")


@dataclass(frozen=True)
class Claim:
    notebook: str
    phrase: str   # the number with the word after it ("300 ms")
    sentence: str  # where it stands, shortened

    def __str__(self) -> str:
        return f"{self.notebook}: {self.phrase!r} in: {self.sentence}"


def _blank(match: re.Match) -> str:
    """Replace a span by spaces of the same length (keeps positions and lines)."""
    return re.sub(r"[^\n]", " ", match.group(0))


# A MyST directive's fences hold prose (a note, a margin, an admonition): only its
# fence lines are blanked, so its numbers are scanned like the page's. Fenced code and
# math stay masked whole, and so does an exercise: its numbers are the problem's
# givens (the ranks its checker starts, the model it describes), which the checker's
# tests hold to the checker.
_FENCE = re.compile(r"^(```+|~~~+)\s*(\{([\w:-]+)\})?")
_CODE_DIRECTIVES = {"code-cell", "code", "code-block", "math", "mermaid", "exercise"}


def _open_directives(text: str) -> str:
    lines, stack = text.split("\n"), []
    for i, line in enumerate(lines):
        m = _FENCE.match(line)
        if not m:
            continue
        if stack and stack[-1][0] == "code":
            if line.startswith(stack[-1][1]) and not line.strip()[len(stack[-1][1]):]:
                stack.pop()  # the code fence closes: _SPAN_RE masks it whole
            continue
        name = m.group(3)
        if name and name not in _CODE_DIRECTIVES:
            stack.append(("directive", m.group(1)))
            lines[i] = " " * len(line)
        elif not m.group(2) and not line.strip()[len(m.group(1)):] and stack and \
                stack[-1] == ("directive", m.group(1)):
            stack.pop()
            lines[i] = " " * len(line)
        else:
            stack.append(("code", m.group(1)))
    return "\n".join(lines)


def _markdown_cells(path: str) -> list[str]:
    with open(path) as f:
        nb = json.load(f)
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


def _sentence(text: str, start: int, end: int) -> str:
    lo = max(text.rfind(". ", 0, start) + 2, text.rfind("\n\n", 0, start) + 2, 0)
    hi_candidates = [i for i in (text.find(". ", end), text.find("\n\n", end))
                     if i != -1]
    hi = min(hi_candidates) if hi_candidates else len(text)
    return " ".join(text[lo:hi + 1].split())[:160]


def allowed(notebook: str) -> list[str]:
    """The allow-list phrases of ``notebook`` (comments after ``#`` dropped)."""
    path = os.path.join(ALLOW_DIR, os.path.splitext(notebook)[0] + ".txt")
    if not os.path.exists(path):
        return []
    phrases = []
    with open(path) as f:
        for line in f:
            phrase = line.split("#", 1)[0].strip()
            if phrase:
                phrases.append(phrase)
    return phrases


def claims_in_text(text: str, notebook: str, allow: list[str]) -> list[Claim]:
    """The unaccounted digit-bearing phrases of one markdown text."""
    if text.lstrip().startswith("#") and "\n" not in text.strip():
        return []  # a heading cell: numbered titles only
    raw = text
    masked = _SPAN_RE.sub(_blank, _open_directives(text))
    # Headings are titles ("## 3. Ring all-reduce"), not claims.
    masked = re.sub(r"^#+ .*$", _blank, masked, flags=re.M)
    flat = " ".join(raw.split())
    found = []
    for m in _NUMBER.finditer(masked):
        start, end = m.span()
        before = masked[max(0, start - 24):start]
        if _NAME_BEFORE.search(before) or _NAME_AFTER.match(masked[end:end + 20]):
            continue
        if _WORLD_AFTER.match(masked[end:end + 12]):
            continue
        line_start = masked.rfind("\n", 0, start) + 1
        if not masked[line_start:start].strip() and masked[end:end + 1] in ".)":
            continue  # an enumerated list's "1."
        number = m.group(0).strip()
        if _YEAR.match(number.lstrip("+-−")):
            continue
        after = re.match(r"\s*([%\w/µ]+)?", masked[end:end + 24])
        unit = after.group(1) if after and after.group(1) else ""
        phrase = f"{number} {unit}".strip() if unit else number
        sentence = _sentence(raw, start, end)
        context = " ".join(raw[max(0, start - 60):end + 60].split())
        if any(a in context or a in sentence or a in flat[:0] for a in allow):
            continue
        found.append(Claim(notebook, phrase, sentence))
    found.extend(_worded_claims(raw, masked, notebook, allow))
    return found


def _worded_claims(raw: str, masked: str, notebook: str, allow: list[str]
                   ) -> list[Claim]:
    """Numbers in words, values computed inside math, and sizes written as names."""
    hits = [m.span() for pattern in (_NUMBER_WORDS, _RATIO_WORDS, _SIZE_NAME)
            for m in pattern.finditer(masked)]
    code = re.compile(r"```.*?```|~~~.*?~~~|`[^`]*`", re.S)
    for math in _MATH.finditer(code.sub(_blank, raw)):
        for m in _MATH_VALUE.finditer(math.group(1)):
            lhs = m.group(1).strip()
            if lhs and not _SYMBOL.match(lhs):
                hits.append((math.start(1) + m.start(3), math.start(1) + m.end(3)))
    out = []
    for start, end in sorted(hits):
        sentence = _sentence(raw, start, end)
        context = " ".join(raw[max(0, start - 60):end + 60].split())
        if "{cite" in sentence or any(a in context or a in sentence for a in allow):
            continue  # a published figure beside its citation, or allow-listed
        if re.search(r"\{glue:text\}`[^`]*`\s*$", raw[max(0, start - 60):start]):
            continue  # "{glue} billion parameters": the number is glued
        out.append(Claim(notebook, " ".join(raw[start:end].split()), sentence))
    return out


def claims(notebook_path: str) -> list[Claim]:
    """Every unaccounted digit-bearing phrase in the markdown of one notebook."""
    name = os.path.basename(notebook_path)
    allow = allowed(name)
    out: list[Claim] = []
    for text in _markdown_cells(notebook_path):
        out.extend(claims_in_text(text, name, allow))
    return out


def all_claims() -> list[Claim]:
    nb_dir = os.path.join(ROOT, "notebooks")
    out: list[Claim] = []
    for name in sorted(os.listdir(nb_dir)):
        if name.endswith(".ipynb"):
            out.extend(claims(os.path.join(nb_dir, name)))
    return out


if __name__ == "__main__":
    import collections
    import sys

    found = all_claims()
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    for c in found:
        if only in c.notebook:
            print(c)
    print(collections.Counter(c.notebook for c in found))
