"""The user-facing configuration error, below every package that raises it.

``parallel`` (the runtime's degree checks), ``plan`` (the planner's inputs and plan files) and the
trainer's validation all refuse a launch with one line naming the flag and the fix; they share this
class so one ``except ConfigError`` catches them all, and so ``plan`` need not import ``parallel``
for it (``tests/test_import_graph.py``)."""
from __future__ import annotations

import argparse


class ConfigError(ValueError):
    """A user-facing configuration error: one line naming the flag and the fix."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``prog: error: ...``, exit 2), without
    the usage block argparse prints first: a bad choice should not bury its message under 45
    lines of flags (``--help`` still prints them all). Every CLI of ours parses with it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def comma_names(flag: str, text: str, allowed, *, aliases: dict[str, str] | None = None,
                error: type[Exception] = ConfigError) -> tuple[str, ...]:
    """The comma-separated names ``text`` of ``flag`` (``--kinds``, ``--backends``, ...): each one
    of ``allowed`` (or an alias of one, replaced by it), none twice; else ``error``, one line
    naming the flag and the names it takes."""
    aliases = aliases or {}
    names = tuple(aliases.get(n.strip(), n.strip()) for n in text.split(","))
    also = "".join(f"; {k} = {v}" for k, v in aliases.items())
    for n in names:
        if n not in allowed:
            raise error(f"{flag}: {n!r} is not one of {', '.join(allowed)}{also}; give a comma-separated "
                        f"list of them (e.g. {flag} {','.join(allowed)})")
    if len(set(names)) != len(names):
        raise error(f"{flag} {text} names one twice; give each once")
    return names


def range_refusal(flag: str, value, low, *, inclusive: bool = True, high=None) -> str:
    """Empty when ``value`` of ``flag`` is within range (``>= low``, or ``> low`` when not
    ``inclusive``; below ``high`` when given); else the one line that refuses it, in the one
    wording every parser uses (the trainer, the simulator and profiler, the benchmarks)."""
    if (value >= low if inclusive else value > low) and (high is None or value < high):
        return ""
    where = f"[{low}, {high})" if high is not None else f">= {low}" if inclusive else f"> {low}"
    return f"{flag} must be {where} (got {value})"
