"""Task graph files (io/TASKS.md): programs over named tensors of a store, as pure values.

A graph file (TOML, or JSON with the same fields) names a store and a list of tasks; each task
runs the entry function of an IR program on a mesh, reads its inputs from named tensors of the
store and writes the outputs it names as store tensors. :func:`parse_task_graph` reads one and
checks what the file alone decides (fields, types of fields, names, duplicates, two tasks
writing one tensor); errors are :class:`~dtm_mpi.errors.TaskGraphError` located
``FILE:LINE:COL`` at the task or field. What needs the programs (parameters, result types,
producer/consumer types) is :mod:`dtm_mpi.plan.task_needs`; the order and placement is
:mod:`dtm_mpi.plan.task_plan`.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtm_mpi.errors import TaskGraphError
from dtm_mpi.sharding.mesh import parse_mesh_binding

__all__ = [
    "GRAPH_FORMAT",
    "GRAPH_VERSION",
    "GraphSpan",
    "TaskGraph",
    "TaskSpec",
    "parse_task_graph",
    "parse_task_graph_text",
    "task_deps",
]

GRAPH_FORMAT = "dtm-tasks"
GRAPH_VERSION = 1
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")
_TOP = {"format", "version", "store", "task"}
_TASK = {"name", "program", "inputs", "outputs", "mesh", "steps", "backend", "after"}
_BACKENDS = ("numpy", "cuda", "hip")


@dataclass(frozen=True, slots=True)
class GraphSpan:
    """A place in a graph file (1-based line and column; 0: the file as a whole)."""

    file: str
    line: int = 0
    col: int = 0

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}" if self.line else self.file


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """One task of a graph: run ``program``'s entry function ``steps`` times on ``mesh`` (axis
    sizes over the program's declared ones) with ``backend``, its parameters in ``inputs``
    read from store tensors, then write the outputs in ``outputs`` (``resultN`` or a
    parameter's final value) as store tensors. ``after``: tasks that must run first though no
    tensor links them."""

    name: str
    program: Path
    inputs: tuple[tuple[str, str], ...]  # (entry parameter without %, store tensor)
    outputs: tuple[tuple[str, str], ...]  # (output key: resultN or a parameter, store tensor)
    mesh: tuple[tuple[str, int], ...] | None
    steps: int
    backend: str
    after: tuple[str, ...]
    span: GraphSpan  # the task's name
    spans: tuple[tuple[str, GraphSpan], ...]  # field or "inputs.KEY" / "outputs.KEY" -> place

    def at(self, key: str) -> GraphSpan:
        """Where ``key`` (a field, ``inputs.P`` or ``outputs.K``) is, else the task."""
        for k, s in self.spans:
            if k == key:
                return s
        field = key.split(".", 1)[0]
        for k, s in self.spans:
            if k == field:
                return s
        return self.span

    @property
    def binding(self) -> dict[str, int] | None:
        return dict(self.mesh) if self.mesh is not None else None


@dataclass(frozen=True, slots=True)
class TaskGraph:
    """A parsed graph file: the store it works on and its tasks in file order."""

    file: str
    store: Path | None
    tasks: tuple[TaskSpec, ...]

    def task(self, name: str) -> TaskSpec:
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(name)

    def producers(self) -> dict[str, TaskSpec]:
        """Store tensor -> the task writing it."""
        return _writers(self.tasks)


def _writers(tasks: Sequence[TaskSpec]) -> dict[str, TaskSpec]:
    """Store tensor -> the task writing it (the last, where a checked graph has one)."""
    return {tensor: t for t in tasks for _, tensor in t.outputs}


class _Locator:
    """Finds where a task's fields are in the text: the task starts at the line holding its
    name's string, a field at the first line after that (and before the next task) holding the
    key. A locator, not a parser: the values themselves come from tomllib/json."""

    def __init__(self, file: str, text: str) -> None:
        self.file = file
        self.lines = text.splitlines()

    def _find(self, pattern: re.Pattern[str], start: int, stop: int) -> GraphSpan | None:
        for i in range(max(0, start), min(stop, len(self.lines))):
            m = pattern.search(self.lines[i])
            if m is not None:
                return GraphSpan(self.file, i + 1, m.start(1) + 1)
        return None

    def top(self, key: str) -> GraphSpan:
        pat = re.compile(rf'^\s*"?({re.escape(key)})"?\s*[=:]')
        return self._find(pat, 0, len(self.lines)) or GraphSpan(self.file)

    def task_starts(self, names: list[Any]) -> list[int]:
        """The 0-based line of each task's name (in order; -1 where not found)."""
        out, at = [], 0
        for name in names:
            pat = re.compile(rf'"?name"?\s*[=:]\s*(["\']){re.escape(str(name))}\1')
            got = self._find(pat, at, len(self.lines))
            if got is None:
                out.append(-1)
                continue
            out.append(got.line - 1)
            at = got.line
        return out

    def field(self, key: str, start: int, stop: int) -> GraphSpan | None:
        pat = re.compile(rf'(?:^|[{{,\s])"?({re.escape(key)})"?\s*[=:]')
        return self._find(pat, start, stop)


def parse_task_graph(path: str | Path) -> TaskGraph:
    """Read and check the graph file ``path`` (``.toml`` or ``.json``)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskGraphError(f"{p}: cannot read the task graph: {exc}") from None
    return parse_task_graph_text(text, str(p), base=p.parent)


def parse_task_graph_text(text: str, file: str, *, base: Path | None = None) -> TaskGraph:
    """Parse graph text (TOML unless ``file`` ends in ``.json``); relative paths are taken
    from ``base`` (default: the current directory)."""
    base = base if base is not None else Path(".")
    doc = _document(text, file)
    loc = _Locator(file, text)
    for key in doc:
        if key not in _TOP:
            raise TaskGraphError(
                f"{loc.top(key)}: unknown field {key!r} (known: {', '.join(sorted(_TOP))})"
            )
    fmt, version = doc.get("format", GRAPH_FORMAT), doc.get("version")
    if fmt != GRAPH_FORMAT:
        raise TaskGraphError(f"{loc.top('format')}: format must be {GRAPH_FORMAT!r}; got {fmt!r}")
    if version != GRAPH_VERSION:
        raise TaskGraphError(
            f"{loc.top('version')}: version must be {GRAPH_VERSION} (this reader's); got {version!r}"
        )
    store = doc.get("store")
    if store is not None and (not isinstance(store, str) or not store):
        raise TaskGraphError(f"{loc.top('store')}: store must be a non-empty path string")
    raw = doc.get("task", [])
    if not isinstance(raw, list) or not raw or not all(isinstance(t, dict) for t in raw):
        raise TaskGraphError(
            f"{loc.top('task')}: the graph needs a list of tasks ([[task]] tables)"
        )
    starts = loc.task_starts([t.get("name") for t in raw])
    tasks: list[TaskSpec] = []
    for i, entry in enumerate(raw):
        start = starts[i]
        stop = next((s for s in starts[i + 1 :] if s >= 0), len(loc.lines))
        tasks.append(_task(entry, i, loc, start, stop, base))
    _check_names(tasks)
    _check_cycles(tasks)
    return TaskGraph(file, (base / store) if store else None, tuple(tasks))


def _document(text: str, file: str) -> dict[str, Any]:
    if file.endswith(".json"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TaskGraphError(f"{file}:{exc.lineno}:{exc.colno}: {exc.msg}") from None
        if not isinstance(doc, dict):
            raise TaskGraphError(f"{file}:1:1: a task graph is a JSON object")
        return doc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
        where = f"{file}:{m.group(1)}:{m.group(2)}" if m else file
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc))
        raise TaskGraphError(f"{where}: {msg}") from None


def _task(
    entry: dict[str, Any], index: int, loc: _Locator, start: int, stop: int, base: Path
) -> TaskSpec:
    here = GraphSpan(loc.file, start + 1, 1) if start >= 0 else loc.top("task")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise TaskGraphError(
            f"{here}: task {index + 1} needs a name of letters, digits, '_', '.' and '-' "
            f"(starting with a letter or '_'); got {name!r}"
        )
    spans: list[tuple[str, GraphSpan]] = []

    def at(key: str) -> GraphSpan:
        if start < 0:
            return here
        section, _, sub = key.partition(".")
        got = loc.field(section, start, stop)
        if got is not None and sub:
            got = loc.field(sub, got.line - 1, stop) or got
        return got or here

    def fail(key: str, message: str) -> TaskGraphError:
        return TaskGraphError(f"{at(key)}: task {name!r}: {message}")

    for key in entry:
        if key not in _TASK:
            raise fail(key, f"unknown field {key!r} (known: {', '.join(sorted(_TASK))})")
        spans.append((key, at(key)))
    program = entry.get("program")
    if not isinstance(program, str) or not program:
        raise fail("program", "needs program = the IR file whose entry function it runs")
    inputs = _pairs(entry.get("inputs", {}), "inputs", fail)
    outputs = _pairs(entry.get("outputs", {}), "outputs", fail)
    if not outputs:
        raise fail("outputs", "writes nothing: name at least one output (outputs = {...})")
    for section, pairs in (("inputs", inputs), ("outputs", outputs)):
        spans += [(f"{section}.{key}", at(f"{section}.{key}")) for key, _ in pairs]
    targets = [t for _, t in outputs]
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        raise fail("outputs", f"writes tensor {twice[0]!r} twice")
    mesh = entry.get("mesh")
    binding: tuple[tuple[str, int], ...] | None = None
    if mesh is not None:
        if not isinstance(mesh, str):
            raise fail("mesh", f"mesh is a string AXIS=SIZE[,AXIS=SIZE...]; got {mesh!r}")
        try:
            binding = tuple(parse_mesh_binding(mesh).items())
        except Exception as exc:  # a UsageError naming the bad entry
            raise fail("mesh", str(exc)) from None
    steps = entry.get("steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise fail("steps", f"steps must be an integer >= 1; got {steps!r}")
    backend = entry.get("backend", "numpy")
    if backend not in _BACKENDS:
        raise fail("backend", f"backend must be one of {', '.join(_BACKENDS)}; got {backend!r}")
    after = entry.get("after", [])
    if not isinstance(after, list) or not all(isinstance(a, str) for a in after):
        raise fail("after", f"after is a list of task names; got {after!r}")
    return TaskSpec(
        name,
        base / program,
        inputs,
        outputs,
        binding,
        steps,
        backend,
        tuple(after),
        here,
        tuple(spans),
    )


def _pairs(value: Any, field: str, fail: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise fail(field, f'{field} is a table of NAME = "store tensor"; got {value!r}')
    out = []
    for key, tensor in value.items():
        if not isinstance(tensor, str) or not _NAME.match(tensor):
            raise fail(
                f"{field}.{key}",
                f"{field}.{key}: a store tensor name (letters, digits, '_', '.', '-'); got {tensor!r}",
            )
        out.append((str(key).lstrip("%"), tensor))
    return tuple(out)


def _check_names(tasks: list[TaskSpec]) -> None:
    seen: dict[str, TaskSpec] = {}
    for t in tasks:
        if t.name in seen:
            raise TaskGraphError(
                f"{t.span}: task {t.name!r} is defined twice (first at {seen[t.name].span})"
            )
        seen[t.name] = t
    writers: dict[str, TaskSpec] = {}
    for t in tasks:
        for key, tensor in t.outputs:
            if tensor in writers:
                raise TaskGraphError(
                    f"{t.at('outputs.' + key)}: task {t.name!r} writes tensor {tensor!r}, which "
                    f"task {writers[tensor].name!r} writes too ({writers[tensor].span}); "
                    "each tensor has one producer"
                )
            writers[tensor] = t
    for t in tasks:
        for other in t.after:
            if other not in seen:
                raise TaskGraphError(
                    f"{t.at('after')}: task {t.name!r}: after names {other!r}, which is no task of the graph"
                )


def task_deps(tasks: tuple[TaskSpec, ...] | list[TaskSpec]) -> dict[str, tuple[str, ...]]:
    """Task -> the tasks it needs first (producers of its inputs, then ``after``), in file
    order, each once."""
    writers = _writers(tasks)
    out: dict[str, tuple[str, ...]] = {}
    for t in tasks:
        deps = [writers[tensor].name for _, tensor in t.inputs if tensor in writers]
        deps += list(t.after)
        out[t.name] = tuple(dict.fromkeys(deps))
    return out


def _check_cycles(tasks: list[TaskSpec]) -> None:
    """A cycle (a task needing itself through producers and ``after``) is an error at its
    first task in file order, naming the whole loop."""
    deps = task_deps(tasks)
    by_name = {t.name: t for t in tasks}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    for root in (t.name for t in tasks):
        if state.get(root):
            continue
        path: list[str] = []
        stack: list[tuple[str, int]] = [(root, 0)]
        while stack:
            name, i = stack.pop()
            if i == 0:
                state[name] = 1
                path.append(name)
            ds = deps[name]
            if i < len(ds):
                stack.append((name, i + 1))
                d = ds[i]
                if state.get(d) == 1:
                    loop = [*path[path.index(d) :], d]
                    first = min(loop[:-1], key=lambda n: tasks.index(by_name[n]))
                    raise TaskGraphError(
                        f"{by_name[first].span}: the tasks form a cycle: "
                        + " -> ".join(
                            f"{n} ({by_name[n].span.line})" if by_name[n].span.line else n
                            for n in loop
                        )
                        + " (each needs the next first: an input it produces, or after)"
                    )
                if not state.get(d):
                    stack.append((d, 0))
            else:
                state[name] = 2
                path.pop()
