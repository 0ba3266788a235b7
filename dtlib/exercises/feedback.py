"""The feedback a checker gives: :class:`WrongAnswer`, shown as a short message.

Its own module so that :mod:`dtlib.exercises.tripwires` can raise one without
importing the checkers' package.
"""

from __future__ import annotations

from dtlib.runtime.i18n import _


class WrongAnswer(AssertionError):
    """The learner's answer is wrong.

    ``what`` says what is wrong; ``hint`` where to look (a message ``"... Hint: ..."``
    is split at the hint). ``str()`` holds both; a notebook shows the hint from the
    second wrong try on (``attempt``, set by :func:`checker`).
    """

    def __init__(self, message: str, hint: str = "") -> None:
        what, sep, embedded = message.partition(" Hint: ")
        if not sep:
            what, sep, embedded = message.partition("\nHint: ")
        if not sep:  # a translated message: its own word for "Hint"
            what, sep, embedded = message.partition(_(" Hint: ").strip())
        self.what = what.rstrip()
        self.hint = (hint or embedded).strip()
        self.attempt = 1
        self.exercise = ""
        super().__init__(self.what + (_(" Hint: ") + self.hint if self.hint else ""))

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing a traceback: the learner sees the
        # feedback, not the checker's source.
        not_yet, hint_label = _("Not yet"), _("Hint")
        head = f"\x1b[1;31m{not_yet}\x1b[0m" + (f" ({self.exercise})"
                                               if self.exercise else "")
        lines = [_("{head}: {what}").format(head=head, what=self.what)]
        if self.hint and self.attempt >= 2:
            lines.append(_("{hint_label}: {hint}").format(
                hint_label=f"\x1b[1m{hint_label}\x1b[0m", hint=self.hint))
        elif self.hint:
            lines.append(_("(Change your answer and run the cell again; a hint comes "
                           "from the second try on.)"))
        return lines


WrongAnswer.__module__ = "dtlib.exercises"  # where learners import it from
