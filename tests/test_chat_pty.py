"""``kimi-jax chat`` as a user meets it (issue 36): no flags, the shipped demo model, a terminal, two turns. Each reply
shows its thinking (dimmed) and then a non-empty answer. Was: ``kimi>`` and then ``[reply cut at ...]``, because the
demo model never left the thinking channel and the chat printed only the answer channel."""

import os
import re
import select
import subprocess
import sys
import time

import pytest

from kimi_jax.cli.generate import DIM, PLAIN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class Terminal:
    """A command on a pseudo-terminal: what it writes, and lines typed to it."""

    def __init__(self, argv):
        master, slave = os.openpty()
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.fd, self.text = master, ""

    def read_until(self, pattern: str, count: int, timeout: float) -> str:
        """Read until ``pattern`` has appeared ``count`` times in all the output so far."""
        deadline = time.monotonic() + timeout
        while self.text.count(pattern) < count:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.text[-3000:]
            ready, _, _ = select.select([self.fd], [], [], 1.0)
            if ready:
                try:
                    self.text += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:  # the command exited and the terminal closed
                    break
        return self.text

    def type(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        os.close(self.fd)


def _turns(text: str) -> list[tuple[str, str]]:
    """(thinking, answer) of each reply on the screen: after ``kimi>``, the dim ``[thinking]`` part, then the answer
    line."""
    out = []
    for seg in text.split("kimi> ")[1:]:
        thought, _, rest = seg.partition(PLAIN)
        assert thought.startswith(DIM + "[thinking] "), seg[:300]
        answer = rest.lstrip("\r\n").split("\r\n")[0]
        out.append((ANSI.sub("", thought).removeprefix("[thinking] ").strip(), ANSI.sub("", answer).strip()))
    return out


@pytest.mark.slow
def test_chat_with_the_defaults_answers_on_a_terminal():
    term = Terminal([sys.executable, "-c", "import sys; from kimi_jax.cli import main; sys.exit(main())", "chat"])
    try:
        term.read_until("you> ", 1, 300)
        term.type("Hi")
        term.read_until("you> ", 2, 300)
        term.type("What does the json module do?")
        text = term.read_until("you> ", 3, 300)
        term.type("/exit")
        assert term.proc.wait(60) == 0
    finally:
        term.close()
    turns = _turns(text)
    print("\n" + "\n".join(f"thinking: {t!r}\nanswer: {a!r}" for t, a in turns))
    assert len(turns) == 2 and all(t and a for t, a in turns), text[-3000:]
    assert "reply cut" not in text
