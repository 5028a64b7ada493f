"""What the readers share: the one-line error, the read job, a layout they cannot write, how an unknown key is
named (course_lib.frameworks)."""

from __future__ import annotations

import difflib
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from ..cost import ASSUMPTIONS
from ..job import Job


class ConfigError(ValueError):
    """A configuration that cannot be a run: one line naming the values and the rule it breaks."""


class NotWritable(ValueError):
    """A layout the framework's keys cannot write (its spell), so the report does not offer it."""


@dataclass(frozen=True)
class ReadConfig:
    framework: str                 # "torchtitan", "megatron", "deepspeed"
    path: str
    job: Job
    model_name: str
    conventions: list[str] = field(default_factory=list)    # the framework's own rules, and how the course counts them
    not_modelled: list[str] = field(default_factory=list)   # keys read and set, that the report does not count
    unknown: list[str] = field(default_factory=list)        # keys no reader knows, with the nearest known one
    spell: Callable[[Job], dict[str, str]] | None = None   # the framework's: job -> {key: value as in its file}
    # cost.step_time's assumptions as this framework runs the job: what it overlaps (dp_overlap, tp_overlap,
    # overlap_param_gather), the bytes it reduces gradients in (grad_reduce_bytes) and how its kernels run
    # (elementwise_ops, rotary); step_time's default where not given
    assumptions: dict = field(default_factory=dict)
    recipes_convention: str | None = None  # the state convention the framework's other layouts run, where not this one's

    def __post_init__(self):
        unknown = sorted(set(self.assumptions) - set(ASSUMPTIONS))
        if unknown:
            raise ValueError(f"ReadConfig assumptions {unknown}: step_time takes {', '.join(ASSUMPTIONS)}")

    def changes(self, other: Job) -> list[str]:
        """The lines of this framework's file that turn this job into ``other`` (a layout the planner found): each
        key with its new value, or "add"/"remove" for a switch ("(on)", "(off)")."""
        ours, theirs = self.spell(self.job), self.spell(other)
        words = {"(on)": "add {key}", "(off)": "remove {key}"}
        return [words.get(value, "{key} {value}").format(key=key, value=value)
                for key, value in theirs.items() if ours.get(key) != value]


def nearest(key: str, known) -> str:
    """``key`` named beside the nearest known key: how a typo is reported."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"{key}: unknown" + (f" (did you mean {close[0]}?)" if close else " (no known key is close)")


def whole(name: str, value, low: int = 1) -> int:
    """A whole number >= ``low`` from a configuration, or a ConfigError naming the key."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} = {value!r}: must be a whole number >= {low}")
    return value


def arguments(text: str) -> list[str]:
    """A shell script's tokens: continuation lines joined, comments dropped, ``NAME=value`` variables substituted
    (once each, in the order written: a variable defined from another takes its value so far), and a token holding
    several flags (``GPT_ARGS="--num-layers 24 ..."``, an array's ``"--vocab-size 128256"``: it starts with a flag)
    split again, without its ``NAME=``, so that each flag is read where it is written. A quoted text that only
    holds a flag (an ``echo``'s, a ``--data-path`` list) stays one token."""
    text = text.replace("\\\n", " ")
    variables: dict[str, str] = {}
    assignment = r"^\s*(?:export\s+)?([A-Za-z_]\w*)=(?:\"([^\"\n]*)\"|'([^'\n]*)'|([^\s()\"']+))\s*$"
    for name, double, single, bare in re.findall(assignment, text, flags=re.M):   # one line, quoted or bare
        variables[name] = single or _substitute(double + bare, variables)    # bash keeps '...' as written
    try:
        tokens = shlex.split(_substitute(text, variables), comments=True)
        return [part for token in tokens for part in (
            shlex.split(re.sub(r"^[A-Za-z_]\w*=", "", token), comments=True)
            if re.match(r"([A-Za-z_]\w*=)?--\w", token) and re.search(r"\s", token) else [token])]
    except ValueError as error:
        raise ConfigError(f"not a shell argument list ({error})") from None


def _substitute(text: str, variables: dict[str, str]) -> str:
    """$NAME, ${NAME} and ${NAME:-default} (${NAME-default}) replaced by their values, or the default where the
    script sets none, in one pass (a value is never expanded again)."""
    def value(match):
        name = match[1] or match[3]
        if name in variables:
            return variables[name]
        return match[2].strip("\"'") if match[2] is not None else match[0]
    return re.sub(r"\$\{([A-Za-z_]\w*)(?::?-([^}]*))?\}|\$([A-Za-z_]\w*)", value, text)
