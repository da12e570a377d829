"""Property tests of the IR front end (hypothesis).

(a) Randomly generated *valid* modules (one mesh of 1-3 axes; an entry function with float
    parameters, sharded or replicated, some ``state``/``init``; a body of 1-30 ops: unary and
    binary elementwise, matmul, transpose, sum then allreduce, softmax, constant, random): they
    verify; ``parse(print(m)) == m``; printing is a fixed point; renaming every value and
    reformatting (whitespace, newlines, comments, number and type spellings, optional
    ``on @mesh`` / parentheses) keeps ``module_hash``; one change of meaning (an op, a seed, a
    constant, a mesh size) changes it.
(b) Fuzzing: random bytes, random streams of real tokens and small edits of valid modules fed
    to ``check_text`` only ever yield :class:`DiagnosticError` values, each located in the text
    and naming the file.

The generator tracks every value's type (dtype, shape, per-dim sharding, pending sum) with its
own small model of the sharding rules, independent of ``dtm_mpi.ir``.
"""

from __future__ import annotations

import dataclasses
import random
import string
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtm_mpi.errors import DiagnosticError, ParseError
from dtm_mpi.ir import check_text, module_hash, parse_module, print_module
from tests.depth import examples

FILE = "prop.dtm"
AXIS_POOL = ("dp", "tp", "pp", "ep", "sp", "x", "y_1")
FLOAT_DTYPES = ("f16", "bf16", "f32", "f64")
UNARY = ("neg", "exp", "tanh", "relu", "gelu", "sqrt")
BINARY = ("add", "sub", "mul", "maximum")
PUNCT = {"=", ",", ":", "(", ")", "[", "]", "{", "}", "->"}
NAME_CHARS = string.ascii_letters + string.digits + "_."
COMMENT_CHARS = string.ascii_letters + string.digits + " \t\r%@{}[]()/:=,.-*é€∀\u2028\x0b\x0c"

VALID_SETTINGS = settings(
    max_examples=examples(100),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ_SETTINGS = settings(
    max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --- a small model of the IR's types ---------------------------------------------------------


@dataclass(frozen=True)
class Ty:
    """A tensor type: float dtype, shape, mesh axes per dim, pending ``sum`` axes (in order)."""

    dtype: str
    shape: tuple[int, ...]
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()

    @property
    def rank(self) -> int:
        return len(self.shape)

    def used(self) -> set[str]:
        return {a for d in self.dims for a in d} | set(self.partial)


@dataclass(frozen=True)
class V:
    """A use or definition of SSA value number ``vid`` (named at render time)."""

    vid: int


@dataclass(frozen=True)
class F:
    """A float literal (spelled variously at render time)."""

    value: float


@dataclass(frozen=True)
class I:  # noqa: E742 - a short token class name reads best in the op tables below
    """An integer literal."""

    value: int


@dataclass(frozen=True)
class Axes:
    """Mesh axes of a collective: ``dp`` or ``[dp, tp]``."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class Lit:
    """A constant literal: a float or nested lists of floats."""

    value: Any


@dataclass(frozen=True)
class Init:
    """``init KIND(key=value, ...)``."""

    kind: str
    params: tuple[tuple[str, int | float], ...] = ()


Tok = str | V | F | I | Axes | Lit | Ty


@dataclass(frozen=True)
class ParamSpec:
    vid: int
    ty: Ty
    state: bool
    init: Init | None


@dataclass(frozen=True)
class Spec:
    module: str
    mesh: str
    axes: tuple[tuple[str, int], ...]
    params: tuple[ParamSpec, ...]
    results: tuple[tuple[Ty, int | None], ...]  # (type, state param it updates)
    on_mesh: bool
    body: tuple[tuple[Tok, ...], ...]
    returns: tuple[int, ...]
    n_values: int


# A change of meaning: ("axis", i, size) | ("body", line, index, token) | ("init", param, Init)
Mutation = tuple[Any, ...]


@dataclass(frozen=True)
class Case:
    spec: Spec
    names: dict[int, str]
    mutations: tuple[Mutation, ...]
    mutation: Mutation


@dataclass
class Style:
    """How to spell a module: ``rnd`` None gives the plain form (single spaces)."""

    names: dict[int, str]
    rnd: random.Random | None = None
    on_mesh: bool | None = None  # None: as in the spec
    paren_single: bool = False


# --- generation ------------------------------------------------------------------------------


def fresh_names(rnd: random.Random, n: int) -> dict[int, str]:
    """``n`` distinct random value names (``%0``, ``%x.1``, ``%_`` ...)."""
    seen: set[str] = set()
    out: dict[int, str] = {}
    for i in range(n):
        while True:
            name = "%" + "".join(rnd.choice(NAME_CHARS) for _ in range(rnd.randint(1, 6)))
            if name not in seen:
                break
        seen.add(name)
        out[i] = name
    return out


finite = st.floats(allow_nan=False, allow_infinity=False)
literal_floats = st.floats(allow_nan=False) | st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-30, 3e38])


class _Gen:
    def __init__(self, draw: Any, axes: tuple[tuple[str, int], ...]) -> None:
        self.draw = draw
        self.axes = [a for a, _ in axes]
        self.params: list[ParamSpec] = []
        self.values: list[tuple[int, Ty]] = []
        self.body: list[tuple[Tok, ...]] = []
        self.mutations: list[Mutation] = [("axis", i, (n % 4) + 1) for i, (_, n) in enumerate(axes)]
        self.n = 0
        self.limit = 0  # ops in the body
        self.offset: int | None = None  # an integer scalar parameter for random ... offset

    def pick(self, options: Any) -> Any:
        return self.draw(st.sampled_from(list(options)))

    def new_id(self, ty: Ty, *, usable: bool = True) -> int:
        vid = self.n
        self.n += 1
        if usable:  # a value later ops may take (floats only)
            self.values.append((vid, ty))
        return vid

    def axes_for(self, k: int, free: list[str]) -> tuple[str, ...]:
        chosen: list[str] = []
        for _ in range(min(k, len(free))):
            a = self.pick(free)
            free.remove(a)
            chosen.append(a)
        return tuple(chosen)

    def random_type(self) -> Ty:
        dtype = self.pick(FLOAT_DTYPES)
        rank = self.draw(st.integers(0, 3))
        shape = tuple(self.draw(st.integers(1, 8)) for _ in range(rank))
        free = list(self.axes)
        dims = tuple(self.axes_for(self.pick([0, 0, 1, 1, 2]), free) for _ in range(rank))
        return Ty(dtype, shape, dims)

    def random_init(self) -> Init | None:
        kind = self.pick([None, "zeros", "ones", "normal", "uniform"])
        if kind in (None, "zeros", "ones"):
            return None if kind is None else Init(kind)
        seed = self.draw(st.integers(0, 2**40))
        params: list[tuple[str, int | float]] = [("seed", seed)]
        if kind == "normal":
            if self.draw(st.booleans()):
                params.append(("mean", self.draw(finite)))
            if self.draw(st.booleans()):
                params.append(("std", abs(self.draw(finite))))
        else:
            lo, hi = sorted((self.draw(finite), self.draw(finite)))
            params += [("low", lo), ("high", hi)]
        return Init(kind, tuple(params))

    def add_param(
        self, ty: Ty, *, init: Init | None = None, state: bool = False, usable: bool = True
    ) -> int:
        vid = self.new_id(ty, usable=usable)
        index = len(self.params)
        self.params.append(ParamSpec(vid, ty, state, init))
        if init is not None and init.kind in ("normal", "uniform"):
            seed = int(init.params[0][1])
            changed = Init(init.kind, (("seed", seed + 1), *init.params[1:]))
            self.mutations.append(("init", index, changed))
        return vid

    def emit(
        self,
        toks: tuple[Tok, ...],
        ty: Ty,
        mutable_at: int | None = None,
        swap: tuple[str, ...] = (),
    ) -> None:
        vid = self.new_id(ty)
        line = len(self.body)
        self.body.append((V(vid), "=", *toks, ":", ty))
        if mutable_at is not None:
            old = toks[mutable_at]
            for other in swap:
                if other != old:
                    self.mutations.append(("body", line, mutable_at + 2, other))

    # -- ops ----------------------------------------------------------------------------------
    def step(self) -> None:
        vals = self.values
        kinds = ["unary", "binary", "transpose", "constant", "random"]
        if any(t.rank >= 2 for _, t in vals):
            kinds += ["matmul", "matmul"]
        if any(t.rank >= 1 for _, t in vals):
            kinds.append("sum")
        if any(t.partial for _, t in vals):
            kinds.append("allreduce")
        if any(not t.partial and () in t.dims for _, t in vals):
            kinds.append("softmax")
        getattr(self, "op_" + self.pick(kinds))()

    def op_unary(self) -> None:
        vid, t = self.pick(self.values)
        if t.partial:  # only neg is linear in a pending sum
            self.emit(("neg", V(vid)), t)
        else:
            self.emit((self.pick(UNARY), V(vid)), t, 0, UNARY)

    def op_binary(self) -> None:
        a, ta = self.pick(self.values)
        same = [
            (v, t)
            for v, t in self.values
            if (t.dtype, t.shape, t.dims) == (ta.dtype, ta.shape, ta.dims)
        ]
        b, tb = self.pick(same)
        if not ta.partial and not tb.partial:
            self.emit((self.pick(BINARY), V(a), ",", V(b)), tb, 0, BINARY)
            return
        allowed = []
        if ta.partial == tb.partial:
            allowed += ["add", "sub"]
        if not ta.partial or not tb.partial:
            allowed.append("mul")
        if not allowed:  # two different pending sums: combine %a with itself
            b, tb, allowed = a, ta, ["add", "sub"]
        self.emit((self.pick(allowed), V(a), ",", V(b)), ta if ta.partial else tb)

    def op_transpose(self) -> None:
        vid, t = self.pick(self.values)
        perm = tuple(self.draw(st.permutations(range(t.rank))))
        ty = Ty(t.dtype, tuple(t.shape[p] for p in perm), tuple(t.dims[p] for p in perm), t.partial)
        self.emit(("transpose", V(vid), "perm", "[", *_commas([I(p) for p in perm]), "]"), ty)

    def op_constant(self) -> None:
        plain = [Ty(t.dtype, t.shape, t.dims) for _, t in self.values]
        ty = self.pick(plain) if self.draw(st.booleans()) else self.random_type()
        numel = 1
        for s in ty.shape:
            numel *= s
        if 1 <= ty.rank <= 2 and numel <= 6 and self.draw(st.booleans()):
            flat = [self.draw(literal_floats) for _ in range(numel)]
            value: Any = _nest(flat, ty.shape)
            changed = _nest([_other_float(flat[0]), *flat[1:]], ty.shape)
        else:
            value = self.draw(literal_floats)
            changed = _other_float(value)
        line = len(self.body)
        self.emit(("constant", Lit(value)), ty)
        self.mutations.append(("body", line, 3, Lit(changed)))

    def op_random(self) -> None:
        plain = [Ty(t.dtype, t.shape, t.dims) for _, t in self.values]
        ty = self.pick(plain) if self.draw(st.booleans()) else self.random_type()
        dist = self.pick(["normal", "uniform"])
        seed = self.draw(st.integers(0, 2**31))
        toks: list[Tok] = ["random", dist, "seed", I(seed)]
        if self.draw(st.booleans()):
            if self.offset is None:
                self.offset = self.add_param(
                    Ty(self.pick(["i32", "i64"]), (), ()), init=Init("zeros"), usable=False
                )
            toks += ["offset", V(self.offset)]
        if dist == "normal":
            if self.draw(st.booleans()):
                toks += ["mean", F(self.draw(finite))]
            if self.draw(st.booleans()):
                toks += ["std", F(abs(self.draw(finite)))]
        elif self.draw(st.booleans()):
            lo, hi = sorted((self.draw(finite), self.draw(finite)))
            toks += ["low", F(lo), "high", F(hi)]
        line = len(self.body)
        self.emit(tuple(toks), ty)
        self.mutations.append(("body", line, 5, I(seed + 1)))

    def op_matmul(self) -> None:
        vid, t = self.pick([(v, t) for v, t in self.values if t.rank >= 2])
        batch, bdims = t.shape[:-2], t.dims[:-2]
        free = [a for a in self.axes if a not in t.used()]
        new_size = self.draw(st.integers(1, 8))
        new_axes = self.axes_for(self.pick([0, 1]), free)
        if self.draw(st.booleans()):  # %t [.., M, K] x %w [.., K, N]
            k, k_axes = t.shape[-1], t.dims[-1]
            wty = Ty(t.dtype, (*batch, k, new_size), (*bdims, k_axes, new_axes))
            out = Ty(
                t.dtype,
                (*batch, t.shape[-2], new_size),
                (*bdims, t.dims[-2], new_axes),
                t.partial + k_axes,
            )
            w = self.operand_of(wty)
            self.emit(("matmul", V(vid), ",", V(w)), out)
        else:  # %w [.., M, K] x %t [.., K, N]
            k, k_axes = t.shape[-2], t.dims[-2]
            wty = Ty(t.dtype, (*batch, new_size, k), (*bdims, new_axes, k_axes))
            out = Ty(
                t.dtype,
                (*batch, new_size, t.shape[-1]),
                (*bdims, new_axes, t.dims[-1]),
                t.partial + k_axes,
            )
            w = self.operand_of(wty)
            self.emit(("matmul", V(w), ",", V(vid)), out)

    def operand_of(self, ty: Ty) -> int:
        """A value of type ``ty``: an existing one, or a new parameter."""
        have = [v for v, t in self.values if t == ty]
        if have and self.draw(st.booleans()):
            return int(self.pick(have))
        return self.add_param(ty, init=self.random_init())

    def op_sum(self) -> None:
        vid, t = self.pick([(v, t) for v, t in self.values if t.rank >= 1])
        dims = self.draw(
            st.lists(st.integers(0, t.rank - 1), min_size=1, max_size=t.rank, unique=True)
        )
        keep = self.draw(st.booleans())
        new = tuple(a for d in sorted(dims) for a in t.dims[d] if a not in t.partial)
        shape, ldims = [], []
        for i, (s, ax) in enumerate(zip(t.shape, t.dims, strict=True)):
            if i not in dims:
                shape.append(s)
                ldims.append(ax)
            elif keep:
                shape.append(1)
                ldims.append(())
        ty = Ty(t.dtype, tuple(shape), tuple(ldims), t.partial + new)
        flag: tuple[Tok, ...] = ("keepdims",) if keep else ()
        self.emit(("sum", V(vid), "dims", "[", *_commas([I(d) for d in dims]), "]", *flag), ty)
        if ty.partial and len(self.body) < self.limit and self.draw(st.integers(0, 3)):
            self.allreduce(self.n - 1, ty)

    def op_allreduce(self) -> None:
        vid, t = self.pick([(v, t) for v, t in self.values if t.partial])
        self.allreduce(vid, t)

    def allreduce(self, vid: int, t: Ty) -> None:
        order = self.draw(st.permutations(t.partial))
        chosen = tuple(order[: self.draw(st.integers(1, len(order)))])
        rest = tuple(a for a in t.partial if a not in chosen)
        self.emit(
            ("allreduce", "sum", V(vid), "on", Axes(chosen)), Ty(t.dtype, t.shape, t.dims, rest)
        )

    def op_softmax(self) -> None:
        vid, t = self.pick([(v, t) for v, t in self.values if not t.partial and () in t.dims])
        dim = self.pick([i for i, d in enumerate(t.dims) if not d])
        self.emit(("softmax", V(vid), "dim", I(dim)), t)


def _commas(items: list[Tok]) -> list[Tok]:
    out: list[Tok] = []
    for i, item in enumerate(items):
        if i:
            out.append(",")
        out.append(item)
    return out


def _nest(flat: list[float], shape: tuple[int, ...]) -> Any:
    if len(shape) == 1:
        return tuple(flat)
    step = len(flat) // shape[0]
    return tuple(_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0]))


def _other_float(value: float) -> float:
    return 0.5 if repr(value) != "0.5" else 1.5


@st.composite
def valid_cases(draw: Any) -> Case:
    n_axes = draw(st.integers(1, 3))
    axis_names = draw(
        st.lists(st.sampled_from(AXIS_POOL), min_size=n_axes, max_size=n_axes, unique=True)
    )
    axes = tuple((a, draw(st.integers(1, 4))) for a in axis_names)
    g = _Gen(draw, axes)
    for _ in range(draw(st.integers(1, 4))):
        g.add_param(g.random_type(), init=g.random_init(), state=draw(st.booleans()))
    g.limit = draw(st.integers(1, 30))
    while len(g.body) < g.limit:
        g.step()
    types = dict(g.values)
    results: list[tuple[Ty, int | None]] = []
    returns: list[int] = []
    candidates = sorted(types)
    for _ in range(draw(st.integers(1, 3))):
        vid = draw(st.sampled_from(candidates))
        results.append((types[vid], None))
        returns.append(vid)
    for p in g.params:  # every state parameter is updated by a value of its type
        if p.state:
            vid = draw(st.sampled_from([v for v in candidates if types[v] == p.ty]))
            at = draw(st.integers(0, len(results)))
            results.insert(at, (p.ty, p.vid))
            returns.insert(at, vid)
    spec = Spec(
        module=draw(st.sampled_from(["t", "mlp", "model_1", "mesh", "entry"])),
        mesh=draw(st.sampled_from(["m", "mesh", "grid.2", "_w"])),
        axes=axes,
        params=tuple(g.params),
        results=tuple(results),
        on_mesh=draw(st.booleans()),
        body=tuple(g.body),
        returns=tuple(returns),
        n_values=g.n,
    )
    names = fresh_names(random.Random(draw(st.integers(0, 2**32 - 1))), g.n)
    mutation = draw(st.sampled_from(g.mutations))
    return Case(spec, names, tuple(g.mutations), mutation)


def mutate(spec: Spec, m: Mutation) -> Spec:
    if m[0] == "axis":
        axes = list(spec.axes)
        axes[m[1]] = (axes[m[1]][0], m[2])
        return dataclasses.replace(spec, axes=tuple(axes))
    if m[0] == "init":
        params = list(spec.params)
        params[m[1]] = dataclasses.replace(params[m[1]], init=m[2])
        return dataclasses.replace(spec, params=tuple(params))
    body = [list(line) for line in spec.body]
    body[m[1]][m[2]] = m[3]
    return dataclasses.replace(spec, body=tuple(tuple(line) for line in body))


# --- rendering -------------------------------------------------------------------------------


def _join_tight(items: list[str], rnd: random.Random | None) -> str:
    if rnd is None:
        return ",".join(items)
    return "".join(
        (rnd.choice([",", ", ", " ,", ",\t"]) if i else "") + s for i, s in enumerate(items)
    )


def type_text(t: Ty, rnd: random.Random | None) -> str:
    """The type token; with ``rnd``, inner spaces, explicit ``{-,...}`` and partial spacing vary."""
    pad = (lambda: rnd.choice(["", "", " ", "\t"])) if rnd is not None else (lambda: "")
    text = f"{t.dtype}[{pad()}{_join_tight([str(s) for s in t.shape], rnd)}{pad()}]"
    explicit = any(t.dims) or (rnd is not None and t.rank > 0 and rnd.random() < 0.3)
    if explicit:
        entries = []
        for d in t.dims:
            if not d:
                entries.append("-")
            elif len(d) == 1 and not (rnd is not None and rnd.random() < 0.2):
                entries.append(d[0])
            else:
                entries.append(f"({pad()}{_join_tight(list(d), rnd)}{pad()})")
        text += "{" + _join_tight(entries, rnd) + "}"
    if t.partial:
        gap = rnd.choice([" ", "", "\t", "  "]) if rnd is not None else " "
        colon = rnd.choice([":", ": ", " : "]) if rnd is not None else ": "
        text += f"{gap}partial({pad()}sum{colon}{_join_tight(list(t.partial), rnd)}{pad()})"
    return text


def float_text(v: float, rnd: random.Random | None) -> str:
    base = repr(v)
    if rnd is None or base in ("inf", "-inf"):
        return base
    forms = [base, f"{v:.20e}", f"{v:.17g}" if any(c in f"{v:.17g}" for c in ".e") else base]
    if base.startswith("0.") or base.startswith("-0."):
        forms.append(base.replace("0.", ".", 1))
    if not base.startswith("-"):
        forms.append("+" + base)
    return rnd.choice(forms)


def int_text(v: int, rnd: random.Random | None) -> str:
    if rnd is None:
        return str(v)
    return rnd.choice([str(v), str(v), "+" + str(v), "00" + str(v)])


def literal_tokens(value: Any, rnd: random.Random | None) -> list[str]:
    if not isinstance(value, tuple):
        return [float_text(value, rnd)]
    out = ["["]
    for i, item in enumerate(value):
        if i:
            out.append(",")
        out += literal_tokens(item, rnd)
    return [*out, "]"]


def tok_texts(tok: Tok, style: Style) -> list[str]:
    rnd = style.rnd
    if isinstance(tok, str):
        return [tok]
    if isinstance(tok, V):
        return [style.names[tok.vid]]
    if isinstance(tok, F):
        return [float_text(tok.value, rnd)]
    if isinstance(tok, I):
        return [int_text(tok.value, rnd)]
    if isinstance(tok, Ty):
        return [type_text(tok, rnd)]
    if isinstance(tok, Lit):
        return literal_tokens(tok.value, rnd)
    assert isinstance(tok, Axes)
    if len(tok.names) == 1 and not (rnd is not None and rnd.random() < 0.3):
        return [tok.names[0]]
    return ["[", *[x for i, a in enumerate(tok.names) for x in ([","] if i else []) + [a]], "]"]


def init_tokens(init: Init, rnd: random.Random | None) -> list[Tok]:
    if not init.params:
        return ["init", init.kind]
    params = list(init.params)
    if rnd is not None:
        rnd.shuffle(params)  # the parser puts them in canonical order
    inner: list[Tok] = []
    for key, value in params:
        inner += [key, "=", I(value) if isinstance(value, int) else F(value)]
    return ["init", init.kind, "(", *_commas_flat(inner, 3), ")"]


def _commas_flat(items: list[Tok], group: int) -> list[Tok]:
    out: list[Tok] = []
    for i in range(0, len(items), group):
        if i:
            out.append(",")
        out += items[i : i + group]
    return out


def spec_lines(spec: Spec, style: Style) -> list[list[Tok]]:
    rnd = style.rnd
    version = rnd.choice(["1.0", "1.0", "1.00", "01.0"]) if rnd is not None else "1.0"
    lines: list[list[Tok]] = [["dtm", version], ["module", spec.module]]
    mesh: list[Tok] = ["mesh", "@" + spec.mesh, "=", "["]
    for i, (a, n) in enumerate(spec.axes):
        mesh += [*([","] if i else []), a, "=", I(n)]
    lines.append([*mesh, "]"])
    head: list[Tok] = ["entry", "func", "@f", "("]
    for i, p in enumerate(spec.params):
        head += [","] if i else []
        head += (["state"] if p.state else []) + [V(p.vid), ":", p.ty]
        if p.init is not None:
            head += init_tokens(p.init, rnd)
    head += [")", "->"]
    single = len(spec.results) == 1 and spec.results[0][1] is None
    res: list[Tok] = []
    for i, (ty, upd) in enumerate(spec.results):
        res += [*([","] if i else []), ty, *(["updates", V(upd)] if upd is not None else [])]
    head += res if single and not style.paren_single else ["(", *res, ")"]
    on = spec.on_mesh if style.on_mesh is None else style.on_mesh
    head += ["on", "@" + spec.mesh] if on else []
    lines.append([*head, "{"])
    lines += [list(line) for line in spec.body]
    lines.append(["return", *_commas([V(r) for r in spec.returns])])
    lines.append(["}"])
    return lines


def _is_type(text: str) -> bool:
    return "[" in text and text[0].isalpha()


def _separator(rnd: random.Random, prev: str, tok: str, line_start: bool) -> str:
    roll = rnd.random()
    if roll < 0.15 and not _is_type(prev) and (prev in PUNCT or tok in PUNCT) and not line_start:
        return ""
    if roll < 0.25:
        text = "".join(rnd.choice(COMMENT_CHARS) for _ in range(rnd.randint(0, 12)))
        return rnd.choice([" ", "\t", ""]) + "//" + text + "\n" + rnd.choice(["", "  ", "\t"])
    if line_start or roll < 0.35:
        return rnd.choice(["\n", "\r\n", "\n\n  ", " \n\t", "\n    "])
    return rnd.choice([" ", " ", "  ", "\t", " \t "])


def render(spec: Spec, style: Style) -> str:
    lines = [[s for tok in line for s in tok_texts(tok, style)] for line in spec_lines(spec, style)]
    rnd = style.rnd
    if rnd is None:
        return "\n".join(" ".join(line) for line in lines) + "\n"
    out = [rnd.choice(["", "\n", "// leading comment\n", "  "])]
    prev: str | None = None
    for line in lines:
        for j, tok in enumerate(line):
            if prev is not None:
                out.append(_separator(rnd, prev, tok, j == 0))
            out.append(tok)
            prev = tok
    out.append(rnd.choice(["", "\n", "\n// trailing comment", "\n\n"]))
    return "".join(out)


def errors_text(errors: list[DiagnosticError]) -> str:
    return "\n".join(str(e) for e in errors)


# --- (a) valid modules -----------------------------------------------------------------------


@VALID_SETTINGS
@given(case=valid_cases())
def test_generated_modules_verify_and_round_trip(case: Case) -> None:
    text = render(case.spec, Style(case.names))
    module, errors = check_text(text, FILE)
    assert not errors, f"{errors_text(errors)}\n--- module:\n{text}"
    assert module is not None
    printed = print_module(module)
    again = parse_module(printed, "printed.dtm")
    assert again == module, f"parse(print(m)) != m\n--- printed:\n{printed}"
    assert print_module(again) == printed, "printing is not a fixed point"
    canon, canon_errors = check_text(printed, "printed.dtm")
    assert not canon_errors, errors_text(canon_errors)
    assert canon == module
    assert module_hash(again) == module_hash(module)


@VALID_SETTINGS
@given(case=valid_cases(), seed=st.integers(0, 2**32 - 1), flips=st.booleans())
def test_hash_ignores_names_whitespace_and_comments(case: Case, seed: int, flips: bool) -> None:
    rnd = random.Random(seed)
    text = render(case.spec, Style(case.names))
    module, errors = check_text(text, FILE)
    assert module is not None and not errors, errors_text(errors)
    style = Style(
        fresh_names(rnd, case.spec.n_values),
        rnd=rnd,
        on_mesh=(not case.spec.on_mesh) if flips else None,  # the only mesh: implied
        paren_single=flips,
    )
    variant = render(case.spec, style)
    other, other_errors = check_text(variant, "variant.dtm")
    assert other is not None and not other_errors, (
        f"{errors_text(other_errors)}\n--- variant:\n{variant}"
    )
    assert module_hash(other) == module_hash(module), (
        f"--- original:\n{text}\n--- variant:\n{variant}\n--- canonical (positional):\n"
        f"{print_module(module, positional_names=True)}\n--- variant canonical:\n"
        f"{print_module(other, positional_names=True)}"
    )


@VALID_SETTINGS
@given(case=valid_cases())
def test_hash_changes_with_meaning(case: Case) -> None:
    text = render(case.spec, Style(case.names))
    module, errors = check_text(text, FILE)
    assert module is not None and not errors, errors_text(errors)
    changed_text = render(mutate(case.spec, case.mutation), Style(case.names))
    changed, changed_errors = check_text(changed_text, FILE)
    assert changed is not None and not changed_errors, (
        f"{errors_text(changed_errors)}\n--- mutated ({case.mutation}):\n{changed_text}"
    )
    assert changed != module
    assert module_hash(changed) != module_hash(module), f"mutation {case.mutation}"


# --- (b) fuzzing: only diagnostics, located and naming the file ------------------------------

HEADER = "dtm 1.0\nmodule t\n"
VOCAB = [
    "dtm",
    "1.0",
    "2.0",
    "module",
    "t",
    "mesh",
    "@m",
    "=",
    "[",
    "dp",
    "tp",
    "2",
    "0",
    "-1",
    "]",
    "func",
    "entry",
    "@f",
    "@g",
    "(",
    ")",
    "%x",
    "%y",
    "%0",
    ":",
    "f32[4,4]{dp,-}",
    "f32[4,4]",
    "f32[4]",
    "f32[]",
    "i32[4]{tp}",
    "bf16[2,3]{(dp,tp),-}",
    "f32[4,4]{dp}",
    "f32[4,4] partial(sum: dp)",
    "->",
    "{",
    "}",
    "return",
    "add",
    "matmul",
    "allreduce",
    "sum",
    "on",
    ",",
    "partial(sum: dp)",
    "dims",
    "keepdims",
    "perm",
    "dim",
    "softmax",
    "transpose",
    "gelu",
    "neg",
    "exp",
    "call",
    "state",
    "init",
    "normal",
    "uniform",
    "zeros",
    "seed",
    "std",
    "updates",
    "requires",
    "[CAP_QUANT]",
    "CAP_QUANT",
    "constant",
    "inf",
    "-inf",
    "nan",
    "-",
    "true",
    '"s"',
    "//",
    "send",
    "recv",
    "from",
    "to",
    "tag",
    "reshape",
    "concat",
    "where",
    "compare",
    "lt",
    "cast",
    "broadcast",
    "root",
    "iota",
    "quantize",
    "block",
    "layer_norm",
    "eps",
    "allgather",
    "reduce_scatter",
    "all_to_all",
    "redistribute",
    "slice",
    "start",
    "limit",
    "max",
    "prod",
    "1e5",
    "0.5",
    "-0.0",
    "%",
    "random",
    "offset",
    "mean",
    "low",
    "high",
    "i64[]",
    "step_index",
]
SEPARATORS = [" ", " ", "\n", "  ", "\t", "", "\r\n", " // c\n"]


def assert_only_diagnostics(text: str) -> None:
    module, errors = check_text(text, FILE)  # must not raise
    lines = text.split("\n")
    if module is None:
        assert len(errors) == 1 and isinstance(errors[0], ParseError), errors
    for err in errors:
        assert isinstance(err, DiagnosticError), (type(err), err)
        span = err.span
        assert span.file == FILE
        assert span.line >= 1 and span.col >= 1, (span, str(err))
        assert span.line <= len(lines), (span, str(err))
        assert span.col <= len(lines[span.line - 1]) + 1, (span, str(err))
        shown = str(err)
        assert shown.startswith(FILE + ":"), shown
        assert shown.startswith(f"{FILE}:{span.line}:{span.col}: "), shown


@FUZZ_SETTINGS
@given(data=st.binary(max_size=400), header=st.booleans())
def test_random_bytes_give_only_diagnostics(data: bytes, header: bool) -> None:
    text = data.decode("utf-8", errors="replace")
    assert_only_diagnostics((HEADER if header else "") + text)


@FUZZ_SETTINGS
@given(
    toks=st.lists(st.tuples(st.sampled_from(VOCAB), st.sampled_from(SEPARATORS)), max_size=80),
    header=st.booleans(),
)
def test_random_token_streams_give_only_diagnostics(
    toks: list[tuple[str, str]], header: bool
) -> None:
    text = "".join(tok + sep for tok, sep in toks)
    assert_only_diagnostics((HEADER if header else "") + text)


@FUZZ_SETTINGS
@given(
    case=valid_cases(),
    edits=st.lists(
        st.tuples(
            st.sampled_from(["delete", "duplicate", "replace", "swap", "vocab"]),
            st.integers(0, 10_000),
            st.integers(0, 10_000),
            st.sampled_from(VOCAB),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_edited_valid_modules_give_only_diagnostics(
    case: Case, edits: list[tuple[str, int, int, str]]
) -> None:
    """Small token edits of a valid module reach the verifier's rules; still diagnostics only."""
    style = Style(case.names)
    toks = [
        s for line in spec_lines(case.spec, style) for tok in line for s in tok_texts(tok, style)
    ]
    for kind, at, other, word in edits:
        i, j = at % len(toks), other % len(toks)
        if kind == "delete" and len(toks) > 1:
            del toks[i]
        elif kind == "duplicate":
            toks.insert(i, toks[j])
        elif kind == "replace":
            toks[i] = toks[j]
        elif kind == "swap":
            toks[i], toks[j] = toks[j], toks[i]
        else:
            toks[i] = word
    assert_only_diagnostics(" ".join(toks) + "\n")
