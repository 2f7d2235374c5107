"""Every log event and journal type the code emits is documented in docs/operations.md.

Operators alert and script on the names, so a name the docs do not list is one nobody can find.
The names are collected statically, with ``ast``, over ``supervisor/**/*.py``:

- log events: the first positional argument of ``.debug/.info/.warning/.error/.critical/
  .exception`` (the second of ``.log(level, event)``) on a structlog logger: ``self.log``,
  ``self._log``, ``log``, ``logger``, ``structlog.get_logger()`` and its ``.bind(...)``, a local
  bound to one of their methods (``log = self.log.info if ... else self.log.warning``) and
  ``getattr(logger, level)(event)``; the event of ``RepeatLimiter.log(key, level, event, ...)``
  and ``RepeatLimitedHandler(event)``, and a dict literal's ``"event"`` (the log sink's own line);
- journal types (``GET /api/v1/events``): the type of ``journal.append(at, type_, ...)`` and of
  ``WorkerRunner``'s ``_on_event(runner, type, fields)``, which the runtime journals.

A name is a string literal, a conditional of literals, a module constant (of its module or one
it imports from ``supervisor``) or a local assigned only those. A parameter makes its function a
relay (``Runtime._placed(..., event)``, ``Sampler._warn_now_and_then(event)``,
``route_stdlib_logger(name, event)``): the names are collected at every call of a function of
that name. Anything else is dynamic and must be in ``DYNAMIC`` below, which says where its
names come from and are documented; so is a relay whose callers reach it by another name.

The docs: the "Log events" and "Journal events" tables of docs/operations.md, one row per prefix
(`` `supervisor.` | `start`, `ready` (...), ... ``). A name is documented when its prefix's row
lists its suffix in backticks outside parentheses (what is in parentheses describes it: fields,
level); a row of several prefixes, or of none (``postmortem``), lists full names.
"""

from __future__ import annotations

import ast
import functools
import gc
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "supervisor"
OPERATIONS = ROOT / "docs" / "operations.md"

LEVELS = frozenset({"debug", "info", "warning", "error", "critical", "exception"})
#: what the code names its structlog loggers (attributes and locals)
LOGGER_NAMES = frozenset({"log", "_log", "logger", "_logger"})

LOG = "log"
JOURNAL = "journal"


def _ast_of(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(encoding="utf-8"))


def _heal_actions() -> set[str]:
    """``heal.<action>``: every ``ActionKind`` of supervisor/policy/heal.py."""
    for node in _ast_of("supervisor/policy/heal.py").body:
        if (
            isinstance(node, ast.Assign)
            and [ast.unparse(t) for t in node.targets] == ["ActionKind"]
            and isinstance(node.value, ast.Subscript)
            and isinstance(node.value.slice, ast.Tuple)
        ):
            return {
                f"heal.{e.value}"
                for e in node.value.slice.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            }
    raise AssertionError("ActionKind = Literal[...] not found in supervisor/policy/heal.py")


def _operator_commands() -> set[str]:
    """``operator.<action>``: the lower-cased classes of ``WorkerCommand.event``'s annotation
    (``lc.Start | lc.Stop | ...``) in supervisor/runtime.py."""
    for node in ast.walk(_ast_of("supervisor/runtime.py")):
        if isinstance(node, ast.ClassDef) and node.name == "WorkerCommand":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and ast.unparse(item.target) == "event":
                    names = re.findall(r"\w+\.(\w+)", ast.unparse(item.annotation))
                    return {f"operator.{n.lower()}" for n in names}
    raise AssertionError("WorkerCommand.event not found in supervisor/runtime.py")


def _relayed() -> set[str]:
    """A relay: its event is a parameter, whose every value is collected where it is called."""
    return set()


#: Dynamic event names, by (file, function): where their names come from, checked through the
#: function that gives them (a relay gives none: what it is passed is collected at its callers).
DYNAMIC: dict[tuple[str, str], tuple[str, Callable[[], set[str]]]] = {
    # journal type "operator." + the command's lower-cased class: operator.start|stop|restart|
    # drain, the "Journal events" table's `operator.` row
    ("supervisor/runtime.py", "Runtime._command"): (JOURNAL, _operator_commands),
    # journal type "heal." + the action: heal.drain|restart|..., the `heal.` row of the
    # "Journal events" table (the actions are docs/healing.md's "Actions")
    ("supervisor/healing.py", "Healer._record"): (JOURNAL, _heal_actions),
    # relays WorkerRunner's _on_event(runner, type, fields): collected at those calls
    ("supervisor/runtime.py", "Runtime._on_worker_event"): (JOURNAL, _relayed),
    # RepeatLimiter's default emit(level, event, fields): collected at RepeatLimiter.log calls
    ("supervisor/logs.py", "_structlog_emit"): (LOG, _relayed),
    # self.event: collected at RepeatLimitedHandler(event) and route_stdlib_logger(name, event)
    ("supervisor/logs.py", "RepeatLimitedHandler.emit"): (LOG, _relayed),
}


@dataclass(frozen=True, slots=True)
class Site:
    kind: str  # LOG or JOURNAL
    rel: str  # supervisor/x.py
    line: int
    func: str  # the enclosing function's qualified name ("" at module level)
    names: frozenset[str] | None  # None: dynamic
    #: the event is this parameter of its function (name, position past self, parameter name):
    #: what each call of that function passes is collected
    relay: tuple[str, int, str] | None = None

    def where(self) -> str:
        return f"{self.rel}:{self.line} ({self.func or 'module'})"


def _attr_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_logger(node: ast.expr) -> bool:
    if _attr_name(node) in LOGGER_NAMES:
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "get_logger" and _attr_name(node.func.value) == "structlog":
            return True
        if node.func.attr in {"bind", "new"}:
            return _is_logger(node.func.value)
    return False


def _is_level_method(node: ast.expr) -> bool:
    """``<logger>.info`` and the like, or a conditional of them."""
    if isinstance(node, ast.IfExp):
        return _is_level_method(node.body) and _is_level_method(node.orelse)
    return isinstance(node, ast.Attribute) and node.attr in LEVELS and _is_logger(node.value)


def _arg(call: ast.Call, index: int, keyword: str) -> ast.expr | None:
    if len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args[:index]):
        return call.args[index]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _event_arg(call: ast.Call, aliases: frozenset[str]) -> tuple[str, ast.expr | None] | None:
    """(kind, the event expression) when ``call`` emits an event, else None."""
    func = call.func
    name = _attr_name(func)
    if isinstance(func, ast.Attribute):
        owner = _attr_name(func.value) or ""
        if func.attr in LEVELS and _is_logger(func.value):
            return LOG, _arg(call, 0, "event")
        if func.attr == "log" and _is_logger(func.value):
            return LOG, _arg(call, 1, "event")
        if func.attr == "log" and owner.endswith("limiter"):  # RepeatLimiter.log
            return LOG, _arg(call, 2, "event")
        if func.attr == "append" and owner == "journal":
            return JOURNAL, _arg(call, 1, "type_")
    if isinstance(func, ast.Name) and func.id in aliases:
        return LOG, _arg(call, 0, "event")
    if (
        isinstance(func, ast.Call)
        and _attr_name(func.func) == "getattr"
        and func.args
        and _is_logger(func.args[0])
    ):
        return LOG, _arg(call, 0, "event")
    if name == "_on_event":
        return JOURNAL, _arg(call, 1, "type")
    if name == "RepeatLimitedHandler":
        return LOG, _arg(call, 0, "event")
    return None


def _strings(node: ast.expr | None) -> frozenset[str] | None:
    """The literal strings ``node`` can be (a literal, a conditional of them), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return frozenset({node.value})
    if isinstance(node, ast.IfExp):
        body, orelse = _strings(node.body), _strings(node.orelse)
        return None if body is None or orelse is None else body | orelse
    return None


def _constants(tree: ast.Module) -> dict[str, frozenset[str]]:
    """A module's top-level ``NAME = "literal"`` (or annotated)."""
    out: dict[str, frozenset[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = _strings(node.value)
            for t in targets:
                if isinstance(t, ast.Name) and value is not None:
                    out[t.id] = value
    return out


@dataclass(frozen=True, slots=True)
class _Scope:
    """Where a node is: its function (or class, or module) and what is known of its names."""

    path: tuple[str, ...]  # qualified name's parts
    in_class: bool  # a class body: its functions' first parameter is self or cls
    locals: dict[str, frozenset[str] | None]  # None: not known statically (a parameter, ...)
    params: dict[str, int]  # parameter -> position past self (-1: keyword-only)
    aliases: frozenset[str]  # locals bound to a logger's method


_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function's body, not those of functions or classes defined in it."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        sub = stack.pop()
        yield sub
        if not isinstance(sub, _NESTED):
            stack.extend(ast.iter_child_nodes(sub))


def _function_scope(node: ast.FunctionDef | ast.AsyncFunctionDef, outer: _Scope) -> _Scope:
    assigned: dict[str, frozenset[str] | None] = {}
    aliases: set[str] = set()
    plain: set[int] = set()  # the Name nodes assigned by a plain ``name = value``
    for sub in _own_nodes(node):  # a statement comes before its parts
        if isinstance(sub, ast.Assign):
            value = _strings(sub.value)
            for t in sub.targets:
                if isinstance(t, ast.Name):
                    plain.add(id(t))
                    if _is_level_method(sub.value):
                        aliases.add(t.id)
                    before = assigned.get(t.id, frozenset())
                    assigned[t.id] = None if value is None or before is None else before | value
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store) and id(sub) not in plain:
            assigned[sub.id] = None  # a loop's, a tuple's, an augmented assignment's...
    args = node.args
    positional = args.posonlyargs + args.args
    if outer.in_class and positional:
        positional = positional[1:]  # self, cls
    params = {a.arg: i for i, a in enumerate(positional)} | {a.arg: -1 for a in args.kwonlyargs}
    for a in args.posonlyargs + args.args + args.kwonlyargs:
        assigned[a.arg] = None  # a parameter: not known here
    return _Scope((*outer.path, node.name), False, assigned, params, frozenset(aliases))


def _resolve(
    node: ast.expr | None, scope: _Scope, constants: dict[str, frozenset[str]]
) -> frozenset[str] | None:
    static = _strings(node)
    if static is not None or not isinstance(node, ast.Name):
        return static
    if node.id in scope.locals:
        return scope.locals[node.id]
    return constants.get(node.id)


@dataclass(slots=True)
class _Module:
    rel: str
    constants: dict[str, frozenset[str]]
    sites: list[Site]
    #: every call, for relays: (the call, its scope)
    calls: list[tuple[ast.Call, _Scope]]

    def site(self, kind: str, node: ast.expr, event: ast.expr | None, scope: _Scope) -> None:
        relay = None
        if isinstance(event, ast.Name) and event.id in scope.params:
            relay = (scope.path[-1], scope.params[event.id], event.id)
        names = _resolve(event, scope, self.constants)
        where = ".".join(scope.path)
        self.sites.append(Site(kind, self.rel, node.lineno, where, names, relay))

    def visit(self, node: ast.AST, scope: _Scope) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                self.visit(child, _function_scope(child, scope))
                continue
            if isinstance(child, ast.ClassDef):
                self.visit(child, _Scope((*scope.path, child.name), True, {}, {}, frozenset()))
                continue
            if isinstance(child, ast.Call):
                found = _event_arg(child, scope.aliases)
                if found is not None:
                    self.site(found[0], child, found[1], scope)
                self.calls.append((child, scope))
            elif isinstance(child, ast.Dict):
                for key, value in zip(child.keys, child.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "event":
                        self.site(LOG, child, value, scope)
            self.visit(child, scope)


def _imported_constants(
    tree: ast.Module, trees: dict[str, ast.Module]
) -> dict[str, frozenset[str]]:
    out: dict[str, frozenset[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("supervisor"):
            source = trees.get(str(Path(*(node.module or "").split("."))) + ".py")
            if source is None:
                continue
            consts = _constants(source)
            for alias in node.names:
                if alias.name in consts:
                    out[alias.asname or alias.name] = consts[alias.name]
    return out


@functools.cache
def collect() -> tuple[Site, ...]:
    """Every site that emits an event; a relay's site is followed by one per call of it."""
    enabled = gc.isenabled()
    gc.disable()  # the trees are many small objects: collections while parsing double the time
    try:
        return _collect()
    finally:
        if enabled:
            gc.enable()


def _collect() -> tuple[Site, ...]:
    trees = {
        str(p.relative_to(ROOT)): ast.parse(p.read_text(encoding="utf-8"), str(p))
        for p in sorted(PACKAGE.rglob("*.py"))
    }
    modules: list[_Module] = []
    for rel, tree in trees.items():
        module = _Module(rel, {**_imported_constants(tree, trees), **_constants(tree)}, [], [])
        module.visit(tree, _Scope((), False, {}, {}, frozenset()))
        modules.append(module)
    out: list[Site] = []
    for site in (s for m in modules for s in m.sites):
        out.append(site)
        if site.relay is None or (site.rel, site.func) in DYNAMIC:
            continue
        func, index, param = site.relay
        for m in modules:
            for call, scope in m.calls:
                if _attr_name(call.func) == func:
                    arg = _arg(call, index if index >= 0 else 1 << 30, param)
                    names = _resolve(arg, scope, m.constants)
                    out.append(Site(site.kind, m.rel, call.lineno, f"calls {func}", names))
    return tuple(out)


def _heading_table(text: str, heading: str) -> list[tuple[str, str]]:
    """The rows (first cell, second cell) of the first table under ``## heading``."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/operations.md has no '## {heading}' section"
    rows = []
    for line in match.group(1).splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append((cells[0], "|".join(cells[1:])))
    assert len(rows) > 1, f"no table under '## {heading}'"
    return rows[1:]  # past the header row


def _outside_parentheses(cell: str) -> Iterator[str]:
    """The backticked names of ``cell`` at parenthesis depth 0."""
    depth = 0
    for part in re.findall(r"`[^`]*`|[()]", cell):
        if part == "(":
            depth += 1
        elif part == ")":
            depth -= 1
            assert depth >= 0, f"unbalanced ')' in the docs' row: {cell[:80]}..."
        elif depth == 0:
            yield part.strip("`")
    assert depth == 0, f"unbalanced '(' in the docs' row: {cell[:80]}..."


def documented(heading: str) -> set[str]:
    out: set[str] = set()
    for first, names in _heading_table(OPERATIONS.read_text(encoding="utf-8"), heading):
        prefixes = re.findall(r"`([\w.]+\.)`", first)  # none: the row lists full names
        for name in _outside_parentheses(names):
            if not prefixes or any(name.startswith(p) for p in prefixes):
                out.add(name)
            else:
                assert len(prefixes) == 1, f"'{name}' in a row of several prefixes: a full name"
                out.add(prefixes[0] + name)
    return out


@functools.cache
def _emitted() -> tuple[dict[str, set[str]], list[str]]:
    """Names emitted, by kind, each with where; and the dynamic sites no DYNAMIC entry covers."""
    emitted: dict[str, set[str]] = {LOG: set(), JOURNAL: set()}
    unexplained: list[str] = []
    seen: set[tuple[str, str]] = set()
    sites = collect()
    for site in sites:
        if site.names is not None:
            emitted[site.kind] |= site.names
            continue
        key = (site.rel, site.func)
        if site.relay is not None and key not in DYNAMIC:
            if not any(s.func == f"calls {site.relay[0]}" for s in sites):
                unexplained.append(f"{site.where()}: no call of {site.relay[0]} found")
            continue  # its callers' names are collected (or unexplained) in their own sites
        entry = DYNAMIC.get(key)
        if entry is None or entry[0] != site.kind:
            unexplained.append(f"{site.kind} event at {site.where()}")
            continue
        seen.add(key)
    for key, (kind, expand) in DYNAMIC.items():
        if key in seen:
            emitted[kind] |= expand()
        else:
            unexplained.append(f"DYNAMIC entry {key} matches no dynamic name any more: remove it")
    return emitted, unexplained


def test_every_emitted_name_is_resolved() -> None:
    _, unexplained = _emitted()
    assert not unexplained, (
        "event names built at run time that this test cannot check: name them with a literal, "
        "or add the site to DYNAMIC with where its names are documented:\n  "
        + "\n  ".join(unexplained)
    )


def test_log_events_are_documented() -> None:
    emitted, _ = _emitted()
    assert len(emitted[LOG]) > 100  # the collector still finds the loggers
    missing = sorted(emitted[LOG] - documented("Log events"))
    assert not missing, (
        f"{len(missing)} log event(s) the code emits are not in docs/operations.md's "
        "'Log events' table (add each to its prefix's row, with what it means):\n  "
        + "\n  ".join(missing)
    )


def test_journal_types_are_documented() -> None:
    emitted, _ = _emitted()
    assert {"rollout.done", "reload.accepted", "operator.restart"} <= emitted[JOURNAL]
    missing = sorted(emitted[JOURNAL] - documented("Journal events"))
    assert not missing, (
        f"{len(missing)} journal type(s) the code writes are not in docs/operations.md's "
        "'Journal events' table:\n  " + "\n  ".join(missing)
    )


def test_documented_names_are_emitted() -> None:
    """A documented name the code no longer emits misleads whoever alerts on it."""
    emitted, _ = _emitted()
    for kind, heading in ((LOG, "Log events"), (JOURNAL, "Journal events")):
        gone = sorted(documented(heading) - emitted[kind])
        assert not gone, f"documented in '{heading}' but not emitted: {', '.join(gone)}"
