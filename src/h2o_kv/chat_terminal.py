"""The terminal UI of ``h2o-kv chat`` (``h2o_kv.cli``; also ``python -m h2o_kv chat``) over a
:class:`~h2o_kv.chat.ChatSession`: a status line per turn, ``/reset``, ``/stats``, ``/quit``; works with piped stdin;
Ctrl-C stops the current reply, not the session."""

from __future__ import annotations

import sys
from typing import TextIO

from .chat import ChatSession

HELP = "commands: /reset (forget the conversation), /stats (cache details), /quit (or Ctrl-D), /help"


def run_chat(session: ChatSession, stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    """The read-eval-print loop. Returns the number of turns answered. Never exits on a bad line."""
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    echo = not stdin.isatty()  # piped input: show what was read, so the transcript reads like a session
    answered = 0
    out.write(f"h2o-kv chat - {HELP}\n")
    while True:
        out.write("you> ")
        out.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            out.write("\n(Ctrl-C at the prompt does nothing; /quit or Ctrl-D to leave)\n")
            continue
        except (UnicodeDecodeError, ValueError) as err:
            out.write(f"\n(could not read that line: {err}; ignored)\n")
            continue
        if not line:  # EOF
            out.write("\n")
            break
        line = line.rstrip("\r\n")
        if echo:
            out.write(line + "\n")
        command = line.strip()
        if not command:
            out.write("(empty message ignored: type some text, or /quit)\n")
            continue
        if command.startswith("/"):
            name = command.split()[0].lower()
            if name in ("/quit", "/exit"):
                break
            if name == "/reset":
                session.reset()
                out.write("(conversation forgotten; the cache is empty)\n")
            elif name == "/stats":
                for key, value in session.stats().items():
                    out.write(f"  {key}: {value}\n")
            elif name == "/help":
                out.write(HELP + "\n")
            else:
                out.write(f"(unknown command {name!r}; {HELP})\n")
            continue
        out.write("bot> ")
        out.flush()
        try:
            result = session.send(line, out=out)
        except KeyboardInterrupt:
            out.write("\n(interrupted; the conversation was reset)\n")
            session.reset()
            continue
        except Exception as err:  # one bad turn must not end the session
            out.write(f"\n(error: {type(err).__name__}: {err}; the conversation was reset)\n")
            continue
        answered += 1
        out.write("\n" + session.status_line(result) + "\n")
    return answered
