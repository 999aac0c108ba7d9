"""Host lists: ``-H``, hostfiles, Slurm and LSF allocations. Pure functions over text.

Every host name and user name is validated here, once, before it can reach a command
line: only ``[A-Za-z0-9_.-]`` (plus ``:`` inside ``[...]`` for IPv6 literals), and never a
leading ``-`` (which ssh or mpirun would read as an option, e.g. ``-oProxyCommand=...``).
Hostfile parsing takes lines, not paths, so errors carry ``file:line``. Every pattern is
matched whole (``fullmatch``: a ``$`` would let a trailing newline through) and counts are
ASCII digits (``str.isdigit`` also takes ``²``, which ``int`` refuses), at most
``MAX_SLOTS`` ranks per host and ``MAX_HOSTS`` hosts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from . import envs
from .errors import UsageError

_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
MAX_SLOTS = 4096  # ranks on one host (ddl's LOCAL_WORLD_SIZE allows as many)
MAX_HOSTS = 1 << 16  # hosts a node list or a task count may expand to
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


@dataclass(frozen=True)
class HostSpec:
    """One host of the job. ``slots`` is None when the user did not say (then GPUs detected
    on the host, else 1, decide)."""

    name: str
    slots: int | None = None
    user: str | None = None

    @property
    def destination(self) -> str:
        """``user@host`` or ``host``, for ssh."""
        return f"{self.user}@{self.name}" if self.user else self.name


def _checked(pattern: re.Pattern[str], text: str, where: str, what: str, rule: str) -> str:
    """``text`` when ``pattern`` matches all of it, else one line naming the rule: the one
    check a host or user name passes before it can reach a command line."""
    if not pattern.fullmatch(text):
        raise UsageError(f"{where}: invalid {what} {text!r}: use letters, digits, '.', '-', "
                         f"'_' {rule}")
    return text


def validate_hostname(name: str, where: str = "host") -> str:
    """``name`` if it is a host name ssh and mpirun may get, else a UsageError."""
    return _checked(_HOST, name, where, "host name",
                    "(no spaces or shell characters, must not start with '-')")


def validate_user(user: str, where: str = "host") -> str:
    """``user`` if it is a user name ssh may get (``user@host``), else a UsageError."""
    return _checked(_USER, user, where, "user name", "and start with a letter or '_'")


def digits(text: str) -> bool:
    """Whether ``text`` is a whole number in ASCII digits."""
    return re.fullmatch("[0-9]+", text) is not None


def check_slots(count: int, where: str) -> int:
    """A host's rank count: 1..MAX_SLOTS."""
    if not 1 <= count <= MAX_SLOTS:
        raise UsageError(f"{where}: slots must be 1..{MAX_SLOTS} per host, got {count}")
    return count


def _slots(text: str, where: str) -> int:
    if not digits(text):
        raise UsageError(f"{where}: slots must be a positive integer, got {text!r}")
    return check_slots(int(text), where)


def parse_host_token(token: str, where: str = "-H") -> HostSpec:
    """``host``, ``host:N``, ``user@host:N``; IPv6 as ``[::1]:N``."""
    token = token.strip()
    if not token:
        raise UsageError(f"{where}: empty host name")
    user = None
    if "@" in token:
        user, token = token.split("@", 1)
        validate_user(user, where)
    slots = None
    if token.startswith("["):
        end = token.find("]")
        if end < 0:
            raise UsageError(f"{where}: unterminated '[' in {token!r}")
        name, rest = token[: end + 1], token[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise UsageError(f"{where}: unexpected {rest!r} after {name!r}")
            slots = _slots(rest[1:], where)
    elif ":" in token:
        name, _, count = token.rpartition(":")
        slots = _slots(count, where)
    else:
        name = token
    return HostSpec(validate_hostname(name, where), slots, user)


def parse_host_list(text: str, where: str = "-H") -> tuple[HostSpec, ...]:
    """``-H h1:4,h2:4``."""
    hosts = tuple(parse_host_token(t, where) for t in text.split(","))
    return _no_duplicates(hosts, where)


def parse_hostfile(lines: Iterable[str], source: str = "hostfile") -> tuple[HostSpec, ...]:
    """Hostfile lines: ``host``, ``host slots=N``, ``host:N``, ``user@host ...``; ``#``
    comments and blank lines are ignored; ``max_slots=`` is accepted and ignored (Open MPI)."""
    hosts: list[HostSpec] = []
    for lineno, raw in enumerate(lines, 1):
        where = f"{source}:{lineno}"
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        spec = parse_host_token(fields[0], where)
        for field in fields[1:]:
            key, eq, value = field.partition("=")
            if not eq or key not in ("slots", "max_slots", "max-slots"):
                raise UsageError(
                    f"{where}: unexpected {field!r}: expected 'host slots=N' or 'host:N'"
                )
            if key == "slots":
                if spec.slots is not None:
                    raise UsageError(f"{where}: slots given twice for {spec.name!r}")
                spec = HostSpec(spec.name, _slots(value, where), spec.user)
            else:
                _slots(value, where)
        hosts.append(spec)
    if not hosts:
        raise UsageError(f"{source}: no hosts found")
    return _no_duplicates(tuple(hosts), source)


def _no_duplicates(hosts: tuple[HostSpec, ...], where: str) -> tuple[HostSpec, ...]:
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise UsageError(
                f"{where}: host {h.name!r} is listed twice: give it once with slots=N"
            )
        seen.add(h.name)
    return hosts


# ---------------------------------------------------------------------------- Slurm
def expand_nodelist(text: str) -> list[str]:
    """Expand a Slurm node list: ``node[01-04,07],gpu5`` -> node01..node04, node07, gpu5.
    Several bracket groups (``r[1-2]n[1-2]``) expand as a product, left to right."""
    out: list[str] = []
    for item in _split_top(text, envs.SLURM_JOB_NODELIST):
        out.extend(_expand_item(item))
    for name in out:
        validate_hostname(name, envs.SLURM_JOB_NODELIST)
    return out


def _split_top(text: str, where: str) -> list[str]:
    items, depth, cur = [], 0, []
    for ch in text.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"{where}: unbalanced ']' in {text!r}")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise UsageError(f"{where}: unbalanced '[' in {text!r}")
    items.append("".join(cur))
    if any(not i for i in items):
        raise UsageError(f"{where}: empty entry in {text!r}")
    return items


def _expand_item(item: str) -> list[str]:
    m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item, re.DOTALL)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    names: list[str] = []
    for part in ranges.split(","):
        lo, dash, hi = part.partition("-")
        if not digits(lo) or (dash and not digits(hi)):
            raise UsageError(f"SLURM_JOB_NODELIST: bad range {part!r} in {item!r}")
        if not dash:
            names.append(prefix + lo)
            continue
        width = len(lo)
        if int(hi) < int(lo):
            raise UsageError(f"SLURM_JOB_NODELIST: descending range {part!r}")
        _at_most_hosts(len(names) + int(hi) - int(lo) + 1, item)
        names.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
    if not rest:
        return names
    tails = _expand_item(rest)
    _at_most_hosts(len(names) * len(tails), item)
    return [n + tail for n in names for tail in tails]


def _at_most_hosts(count: int, item: str) -> None:
    if count > MAX_HOSTS:
        raise UsageError(f"SLURM_JOB_NODELIST: {item!r} expands to {count} hosts, more than "
                         f"{MAX_HOSTS}")


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE``: ``2(x3),1`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", part.strip())
        if not m:
            raise UsageError(f"SLURM_TASKS_PER_NODE: cannot parse {part!r}")
        times = int(m.group(2) or 1)
        if len(out) + times > MAX_HOSTS:
            raise UsageError(f"SLURM_TASKS_PER_NODE: {text!r} counts more than {MAX_HOSTS} "
                             "hosts")
        out.extend([int(m.group(1))] * times)
    return out


def slurm_hosts(env: Mapping[str, str]) -> tuple[HostSpec, ...]:
    names = expand_nodelist(env.get(envs.SLURM_JOB_NODELIST)
                            or env.get(envs.SLURM_NODELIST, ""))
    tasks = env.get(envs.SLURM_TASKS_PER_NODE) or env.get(envs.SLURM_STEP_TASKS_PER_NODE)
    if tasks:
        counts = expand_tasks_per_node(tasks)
        if len(counts) == len(names):
            return tuple(HostSpec(n, check_slots(c, envs.SLURM_TASKS_PER_NODE))
                         for n, c in zip(names, counts, strict=True))
    return tuple(HostSpec(n) for n in names)


# ---------------------------------------------------------------------------- LSF
def parse_lsb_mcpu_hosts(text: str) -> tuple[HostSpec, ...]:
    """``LSB_MCPU_HOSTS="hostA 4 hostB 4"``."""
    fields = text.split()
    if len(fields) % 2:
        raise UsageError(f"LSB_MCPU_HOSTS: expected 'host count' pairs, got {text!r}")
    hosts = tuple(
        HostSpec(validate_hostname(h, envs.LSB_MCPU_HOSTS), _slots(c, envs.LSB_MCPU_HOSTS))
        for h, c in zip(fields[::2], fields[1::2], strict=True)
    )
    return _no_duplicates(hosts, envs.LSB_MCPU_HOSTS)


def parse_lsb_hostfile(lines: Iterable[str],
                       source: str = envs.LSB_DJOB_HOSTFILE) -> tuple[HostSpec, ...]:
    """One host name per slot (repeated), in order: counted into slots."""
    counts: dict[str, int] = {}
    for lineno, raw in enumerate(lines, 1):
        name = raw.strip()
        if name:
            validate_hostname(name, f"{source}:{lineno}")
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        raise UsageError(f"{source}: no hosts found")
    return tuple(HostSpec(n, c) for n, c in counts.items())


def lsf_hosts(env: Mapping[str, str], read_lines=None) -> tuple[HostSpec, ...]:
    """Hosts of an LSF allocation; ``read_lines(path)`` is the seam for LSB_DJOB_HOSTFILE.
    LSF lists the launch host first; it runs ranks like any other host."""
    path = env.get(envs.LSB_DJOB_HOSTFILE)
    if path:
        reader = read_lines or read_text_lines
        return parse_lsb_hostfile(reader(path), path)
    return parse_lsb_mcpu_hosts(env.get(envs.LSB_MCPU_HOSTS, ""))


def read_text_lines(path: str, what: str = "") -> list[str]:
    """A file's lines, decoded as UTF-8; UsageError naming ``what path:line`` and the byte
    when it cannot be read or is not UTF-8 (a Latin-1 host name)."""
    where = f"{what} {path}" if what else path
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {where}: {exc.strerror}") from None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UsageError(f"{where}:{line}: byte {data[exc.start:exc.start + 1]!r} is not "
                         "UTF-8 text (host names are ASCII: letters, digits, '.', '-', "
                         "'_')") from None


def detect_allocation(env: Mapping[str, str]) -> str | None:
    """'slurm', 'lsf' or None: which scheduler allocation ddlrun runs inside."""
    slurm_hosts_given = env.get(envs.SLURM_JOB_NODELIST) or env.get(envs.SLURM_NODELIST)
    if env.get(envs.SLURM_JOB_ID) and slurm_hosts_given:
        return "slurm"
    lsf_hosts_given = env.get(envs.LSB_DJOB_HOSTFILE) or env.get(envs.LSB_MCPU_HOSTS)
    if env.get(envs.LSB_JOBID) and lsf_hosts_given:
        return "lsf"
    return None


def is_local(name: str, local_names: Iterable[str] = ()) -> bool:
    return name in LOCAL_NAMES or name in set(local_names)


# ---------------------------------------------------------------------------- --include
def parse_selection(text: str, where: str = "--include") -> tuple[
    tuple[str, tuple[str, ...] | None], ...
]:
    """DeepSpeed's ``--include`` / ``--exclude`` syntax: ``host1:0,1@host2`` -> host1's
    GPUs 0 and 1, all of host2 (None). GPU ids are the host's device indices."""
    out: list[tuple[str, tuple[str, ...] | None]] = []
    seen: set[str] = set()
    for part in text.split("@"):
        name, colon, ids = part.strip().partition(":")
        validate_hostname(name, where)
        if name in seen:
            raise UsageError(f"{where}: host {name!r} is given twice")
        seen.add(name)
        if not colon:
            out.append((name, None))
            continue
        got = tuple(i.strip() for i in ids.split(","))
        if not got or not all(digits(i) for i in got):
            raise UsageError(f"{where}: {part!r}: GPU ids must be integers, e.g. "
                             f"{name}:0,1")
        out.append((name, tuple(dict.fromkeys(got))))
    return tuple(out)
