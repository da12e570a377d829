"""Recursive-descent parser for the DTM IR text form (grammar: docs/spec/ir.md).

``parse_module`` raises :class:`ParseError` / :class:`VersionError` with the exact location;
``parse_optional_module`` returns None instead. Op bodies are parsed from each op's declared
format in the registry, so parser and printer cannot drift apart.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from dtm_mpi.errors import ParseError, SourceSpan, VersionError
from dtm_mpi.ir.fastpath import build_op
from dtm_mpi.ir.lexer import Source, Token, leading_tokens, line_tokens, tokenize
from dtm_mpi.ir.limits import MAX_INT_DIGITS, MAX_LITERAL_DEPTH, MAX_VERSION_CHARS
from dtm_mpi.ir.nodes import Attr, Function, Init, InitKind, MeshDecl, Module, Op, Param, ResultSpec
from dtm_mpi.ir.registry import FormatElem, lookup_op
from dtm_mpi.ir.types import TensorType
from dtm_mpi.ir.typetext import parse_type_text

__all__ = ["SUPPORTED_VERSION", "gc_paused", "parse_module", "parse_optional_module"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: parsing allocates about a million small tuples that
    hold no cycles, and collector passes over them cost a third of a large parse."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


SUPPORTED_VERSION = (1, 5)
_KIND_NAMES = {
    "VALUE": "an SSA value (%name)",
    "SYMBOL": "a symbol (@name)",
    "NUMBER": "a number",
    "IDENT": "a word",
    "TYPE": "a tensor type",
    "STRING": "a string",
    "EOF": "end of file",
}


def _shorten(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:20]}..."


def _describe(tok: Token) -> str:
    kind, text, _, _ = tok
    if kind == "EOF":
        return "end of file"
    return f"{text!r}" if kind in ("PUNCT", "ARROW", "IDENT") else f"{_KIND_NAMES[kind]} {text!r}"


def _version(src: Source, vtok: Token) -> tuple[int, int]:
    """The version a header's NUMBER token names; raises :class:`ParseError` for a token that
    is not ``DIGITS.DIGITS`` (or is too long) and :class:`VersionError` for a version this
    reader cannot read."""
    text = vtok[1]
    major_s, dot, minor_s = text.partition(".")
    if not dot or not major_s.isdigit() or not minor_s.isdigit():
        raise src.error(
            ParseError,
            f"expected a version MAJOR.MINOR such as 1.0, found {_shorten(text)!r}",
            vtok[2],
            vtok[3],
            len(text),
        )
    if len(text) > MAX_VERSION_CHARS:
        raise src.error(
            ParseError,
            f"version {_shorten(text)} is {len(text)} characters long; at most "
            f"{MAX_VERSION_CHARS} are allowed",
            vtok[2],
            vtok[3],
            len(text),
        )
    version = (int(major_s), int(minor_s))
    sv = f"{SUPPORTED_VERSION[0]}.{SUPPORTED_VERSION[1]}"
    if version[0] != SUPPORTED_VERSION[0]:
        raise src.error(
            VersionError,
            f"unsupported IR major version {version[0]} (dtm {text}); this reader reads dtm {sv}",
            vtok[2],
            vtok[3],
            len(text),
        )
    if version[1] > SUPPORTED_VERSION[1]:
        raise src.error(
            VersionError,
            f"IR version dtm {text} is newer than this reader (dtm {sv})",
            vtok[2],
            vtok[3],
            len(text),
        )
    return version


def _check_header(src: Source) -> None:
    """Decide on the header's version before lexing anything after it (docs/spec/ir.md,
    section 1): a version error wins over any later lexical error. A text that does not start
    with ``dtm NUMBER`` is left to the token parser, which reports what it finds."""
    toks = leading_tokens(src, 2)
    if len(toks) == 2 and toks[0][:2] == ("IDENT", "dtm") and toks[1][0] == "NUMBER":
        _version(src, toks[1])


class _Parser:
    def __init__(self, source: Source, *, fast: bool = True) -> None:
        self.src = source
        self.file = source.file
        _check_header(source)
        self.toks = tokenize(source, fast=fast)
        self.i = 0

    def unfold(self) -> None:
        """Split a ``STMT`` token at the cursor back into its tokens: it was not where a
        statement goes, and a diagnostic must describe what the token parser would see."""
        tok = self.toks[self.i]
        if tok[0] == "STMT":
            del self.src.fast[tok[2]]
            self.toks[self.i : self.i + 1] = line_tokens(self.src, tok[1], tok[2])

    # -- token helpers ------------------------------------------------------------------------
    def peek(self, k: int = 0) -> Token:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def span(self, tok: Token) -> SourceSpan:
        return SourceSpan(self.file, tok[2], tok[3], len(tok[1]) or 1)

    def fail(self, message: str, tok: Token | None = None) -> ParseError:
        if tok is None:
            self.unfold()
            tok = self.peek()
        return self.src.error(ParseError, message, tok[2], tok[3], len(tok[1]))

    def expected(self, what: str) -> ParseError:
        self.unfold()
        return self.fail(f"expected {what}, found {_describe(self.peek())}")

    def at(self, text: str) -> bool:
        kind, t, _, _ = self.toks[self.i]
        return t == text and kind in ("PUNCT", "ARROW", "IDENT")

    def accept(self, text: str) -> bool:
        if self.at(text):
            self.i += 1
            return True
        return False

    def expect(self, text: str, what: str | None = None) -> Token:
        if not self.at(text):
            raise self.expected(what or repr(text))
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def take(self, kind: str, what: str | None = None) -> Token:
        tok = self.toks[self.i]
        if tok[0] != kind:
            raise self.expected(what or _KIND_NAMES[kind])
        self.i += 1
        return tok

    def take_type(self) -> tuple[TensorType, SourceSpan]:
        tok = self.toks[self.i]
        if tok[0] != "TYPE":
            if tok[0] == "IDENT" and self.peek(1)[1] == "[":
                raise self.fail(
                    f"unknown dtype {tok[1]!r} (expected one of f16 bf16 f32 f64 i8 i32 i64 u8 "
                    "bool)"
                )
            raise self.expected("a tensor type such as f32[64,256]")
        self.i += 1
        return parse_type_text(self.src, tok[1], tok[2], tok[3]), self.span(tok)

    def integer(self, what: str) -> tuple[int, Token]:
        tok = self.take("NUMBER", what)
        text = tok[1]
        digits = text.lstrip("+-")
        if not digits.isdigit():
            raise self.fail(f"expected {what}, found {_shorten(text)!r}", tok)
        self.check_digits(tok, digits)
        return int(text), tok

    def check_digits(self, tok: Token, digits: str) -> None:
        if len(digits) > MAX_INT_DIGITS:
            raise self.fail(
                f"integer {_shorten(tok[1])} has {len(digits)} digits; at most {MAX_INT_DIGITS} "
                "are allowed",
                tok,
            )

    def number(self, what: str) -> tuple[float, Token]:
        tok = self.toks[self.i]
        if tok[0] == "IDENT" and tok[1] in ("inf", "nan"):
            self.i += 1
            return float(tok[1]), tok
        if tok[0] == "PUNCT" and tok[1] == "-" and self.peek(1)[1] == "inf":
            self.i += 2
            return float("-inf"), tok
        tok = self.take("NUMBER", what)
        return float(tok[1]), tok

    # -- module -------------------------------------------------------------------------------
    def module(self) -> Module:
        first = self.peek()
        if not self.at("dtm"):
            raise self.expected("the header 'dtm 1.0' at the start of the module")
        self.i += 1
        vtok = self.take("NUMBER", "a version such as 1.0 after 'dtm'")
        version = _version(self.src, vtok)
        self.expect("module", "'module NAME' after the header")
        name = self.take("IDENT", "a module name")[1]
        meshes: list[MeshDecl] = []
        functions: list[Function] = []
        while self.peek()[0] != "EOF":
            if self.at("mesh"):
                meshes.append(self.mesh())
            elif self.at("func") or self.at("entry"):
                functions.append(self.function())
            else:
                raise self.expected("'mesh', 'func' or 'entry func'")
        return Module(version, name, tuple(meshes), tuple(functions), self.span(first))

    def mesh(self) -> MeshDecl:
        start = self.expect("mesh")
        name = self.take("SYMBOL", "a mesh name (@name)")[1][1:]
        self.expect("=")
        self.expect("[", "'[' starting the mesh axes")
        axes: list[tuple[str, int]] = []
        spans: list[tuple[SourceSpan, SourceSpan]] = []
        while True:
            axis_tok = self.take("IDENT", "a mesh axis name")
            axis = axis_tok[1]
            self.expect("=", f"'=' and a size after axis {axis!r}")
            size, size_tok = self.integer(f"the size of axis {axis!r}")
            axes.append((axis, size))
            spans.append((self.span(axis_tok), self.span(size_tok)))
            if self.accept(","):
                continue
            self.expect("]", "',' or ']' in the mesh axes")
            break
        return MeshDecl(name, tuple(axes), self.span(start), tuple(spans))

    def function(self) -> Function:
        start = self.peek()
        entry = self.accept("entry")
        self.expect("func", "'func' after 'entry'" if entry else "'func'")
        name_tok = self.take("SYMBOL", "a function name (@name)")
        self.expect("(", "'(' starting the parameters")
        params: list[Param] = []
        if not self.at(")"):
            while True:
                params.append(self.param())
                if self.accept(","):
                    continue
                break
        self.expect(")", "',' or ')' after a parameter")
        self.expect("->", "'->' and the result types")
        results: list[ResultSpec] = []
        if self.accept("("):
            if not self.at(")"):
                while True:
                    results.append(self.result_spec())
                    if not self.accept(","):
                        break
            self.expect(")", "',' or ')' after a result type")
        else:
            results.append(self.result_spec())
        mesh: str | None = None
        mesh_span = self.span(name_tok)
        if self.accept("on"):
            tok = self.take("SYMBOL", "a mesh name (@name) after 'on'")
            mesh, mesh_span = tok[1][1:], self.span(tok)
        requires: list[str] = []
        req_spans: list[SourceSpan] = []
        if self.accept("requires"):
            self.expect("[", "'[' after 'requires'")
            while True:
                tok = self.take("IDENT", "a capability name such as CAP_QUANT")
                requires.append(tok[1])
                req_spans.append(self.span(tok))
                if not self.accept(","):
                    break
            self.expect("]", "',' or ']' in the capability list")
        self.expect("{", "'{' starting the function body")
        body: list[Op] = []
        toks, fast, src, file = self.toks, self.src.fast, self.src, self.file

        def parse_type(text: str, line: int, col: int) -> TensorType:
            return parse_type_text(src, text, line, col)

        while True:
            tok = toks[self.i]
            if tok[0] == "STMT":  # the fast path (dtm_mpi.ir.fastpath)
                self.i += 1
                body.append(build_op(fast[tok[2]], file, tok[2], parse_type))
                continue
            if self.at("return"):
                break
            if self.at("}") or tok[0] == "EOF":
                raise self.expected("a statement or 'return'")
            body.append(self.statement())
        ret_tok = self.expect("return")
        returns: list[str] = []
        ret_spans: list[SourceSpan] = []
        if self.peek()[0] == "VALUE":
            while True:
                tok = self.take("VALUE")
                returns.append(tok[1])
                ret_spans.append(self.span(tok))
                if not self.accept(","):
                    break
        self.expect("}", "'}' closing the function after 'return'")
        return Function(
            name_tok[1][1:],
            tuple(params),
            tuple(results),
            tuple(body),
            tuple(returns),
            entry,
            mesh,
            tuple(requires),
            self.span(start if entry else name_tok),
            self.span(ret_tok),
            tuple(ret_spans),
            mesh_span,
            tuple(req_spans),
        )

    def param(self) -> Param:
        state = self.accept("state")
        tok = self.take("VALUE", "a parameter (%name)")
        self.expect(":", f"':' and a type after parameter {tok[1]}")
        ptype, tspan = self.take_type()
        init = self.init() if self.accept("init") else None
        return Param(tok[1], ptype, state, init, self.span(tok), tspan)

    def init(self) -> Init:
        tok = self.take("IDENT", "an initialiser: zeros, ones, store, normal(...), uniform(...)")
        try:
            kind = InitKind(tok[1])
        except ValueError:
            raise self.fail(
                f"unknown initialiser {tok[1]!r} (expected zeros, ones, store, normal or uniform)",
                tok,
            ) from None
        params: list[tuple[str, int | float]] = []
        if kind in (InitKind.NORMAL, InitKind.UNIFORM):
            allowed = (
                ("seed", "mean", "std") if kind is InitKind.NORMAL else ("seed", "low", "high")
            )
            self.expect("(", f"'(' and parameters after {kind.value}")
            while True:
                key_tok = self.take("IDENT", f"one of {', '.join(allowed)}")
                if key_tok[1] not in allowed or any(k == key_tok[1] for k, _ in params):
                    raise self.fail(
                        f"{kind.value}(...) takes {', '.join(allowed)} once each; got "
                        f"{key_tok[1]!r}",
                        key_tok,
                    )
                self.expect("=")
                if key_tok[1] == "seed":
                    seed, _ = self.integer("an integer seed")
                    params.append(("seed", seed))
                else:
                    value, _ = self.number(f"a number for {key_tok[1]}")
                    params.append((key_tok[1], value))
                if not self.accept(","):
                    break
            self.expect(")", f"',' or ')' closing {kind.value}(...)")
            if not any(k == "seed" for k, _ in params):
                raise self.fail(f"{kind.value}(...) needs a seed=N", tok)
            order = {k: i for i, k in enumerate(allowed)}
            params.sort(key=lambda kv: order[kv[0]])
        return Init(kind, tuple(params))

    def result_spec(self) -> ResultSpec:
        start = self.peek()
        rtype, _ = self.take_type()
        updates = None
        if self.accept("updates"):
            updates = self.take("VALUE", "the state parameter (%name) this result updates")[1]
        return ResultSpec(rtype, updates, self.span(start))

    # -- statements ---------------------------------------------------------------------------
    def statement(self) -> Op:
        results: list[str] = []
        result_spans: list[SourceSpan] = []
        if self.peek()[0] == "VALUE":
            while True:
                tok = self.take("VALUE", "a result name (%name)")
                results.append(tok[1])
                result_spans.append(self.span(tok))
                if not self.accept(","):
                    break
            self.expect("=", "'=' after the result names")
        name_tok = self.take("IDENT", "an op name")
        opdef = lookup_op(name_tok[1])
        if opdef is None:
            raise self.fail(f"unknown op {name_tok[1]!r}", name_tok)
        operands: list[str] = []
        operand_spans: list[SourceSpan] = []
        attrs: list[tuple[str, Attr]] = []
        attr_spans: list[tuple[str, SourceSpan]] = []
        self.elems(opdef.format, operands, operand_spans, attrs, attr_spans, name_tok[1])
        types: list[TensorType] = []
        type_spans: list[SourceSpan] = []
        if results:
            self.expect(":", "':' and the result type(s)")
            while True:
                t, s = self.take_type()
                types.append(t)
                type_spans.append(s)
                if not self.accept(","):
                    break
            if len(types) != len(results):
                raise self.fail(
                    f"{len(results)} result name(s) but {len(types)} result type(s)", name_tok
                )
        return Op(
            name_tok[1],
            tuple(results),
            tuple(types),
            tuple(operands),
            tuple(attrs),
            self.span(name_tok),
            tuple(result_spans),
            tuple(operand_spans),
            tuple(type_spans),
            tuple(attr_spans),
        )

    def elems(
        self,
        fmt: tuple[FormatElem, ...],
        operands: list[str],
        operand_spans: list[SourceSpan],
        attrs: list[tuple[str, Attr]],
        attr_spans: list[tuple[str, SourceSpan]],
        opname: str,
    ) -> None:
        for el in fmt:
            kind = el.kind
            if kind in {"kw", "punct"}:
                self.expect(el.name, f"{el.name!r} in {opname}")
            elif kind == "operand":
                tok = self.take("VALUE", f"an operand (%name) in {opname}")
                operands.append(tok[1])
                operand_spans.append(self.span(tok))
            elif kind == "operands":
                if self.peek()[0] != "VALUE":
                    continue  # an empty list (e.g. call @f())
                while True:
                    tok = self.take("VALUE", f"an operand (%name) in {opname}")
                    operands.append(tok[1])
                    operand_spans.append(self.span(tok))
                    if not self.accept(","):
                        break
            elif kind == "opt":
                if self.at(el.group[0].name):
                    self.elems(el.group, operands, operand_spans, attrs, attr_spans, opname)
            elif kind == "flag":
                if self.accept(el.choices[0]):
                    attrs.append((el.name, True))
                    attr_spans.append((el.name, self.span(self.toks[self.i - 1])))
            else:
                start = self.peek()
                attrs.append((el.name, self.attr_value(el, opname)))
                attr_spans.append((el.name, self.span(start)))

    def attr_value(self, el: FormatElem, opname: str) -> Attr:
        kind = el.kind
        if kind == "int":
            return self.integer(f"an integer ({el.name}) in {opname}")[0]
        if kind == "float":
            return self.number(f"a number ({el.name}) in {opname}")[0]
        if kind == "symbol":
            return self.take("SYMBOL", f"a function name (@name) in {opname}")[1][1:]
        if kind == "enum":
            tok = self.take("IDENT", f"one of {', '.join(el.choices)} in {opname}")
            if tok[1] not in el.choices:
                raise self.fail(
                    f"{opname}: expected one of {', '.join(el.choices)}, found {tok[1]!r}", tok
                )
            return tok[1]
        if kind == "ints":
            self.expect("[", f"'[' starting the {el.name} list in {opname}")
            values: list[int] = []
            if not self.at("]"):
                while True:
                    values.append(self.integer(f"an integer in {el.name}")[0])
                    if not self.accept(","):
                        break
            self.expect("]", f"',' or ']' in the {el.name} list")
            return tuple(values)
        if kind == "axes":
            if self.accept("["):
                names = [self.take("IDENT", "a mesh axis name")[1]]
                while self.accept(","):
                    names.append(self.take("IDENT", "a mesh axis name")[1])
                self.expect("]", "',' or ']' in the axis list")
                return tuple(names)
            return (self.take("IDENT", f"a mesh axis name in {opname}")[1],)
        if kind == "literal":
            return self.literal()
        raise AssertionError(kind)

    def literal(self, depth: int = 0) -> Attr:
        if self.accept("["):
            if depth >= MAX_LITERAL_DEPTH:
                raise self.fail(
                    f"literal nested deeper than {MAX_LITERAL_DEPTH} levels", self.toks[self.i - 1]
                )
            items: list[Attr] = []
            if not self.at("]"):
                while True:
                    items.append(self.literal(depth + 1))
                    if not self.accept(","):
                        break
            self.expect("]", "',' or ']' in the literal")
            return tuple(items)
        if self.at("true") or self.at("false"):
            return self.take("IDENT")[1] == "true"
        value, tok = self.number("a number or '[' in the literal")
        if tok[0] == "NUMBER" and all(c in "+-0123456789" for c in tok[1]):
            self.check_digits(tok, tok[1].lstrip("+-"))
            return int(tok[1])
        return value


def parse_module(text: str, file: str = "<input>", *, fast: bool = True) -> Module:
    """Parse a module; raises :class:`ParseError` or :class:`VersionError` with its location.

    ``fast=False`` reads every line with the token parser (the fast path's reference)."""
    with gc_paused():
        return _Parser(Source(text, file), fast=fast).module()


def parse_optional_module(text: str, file: str = "<input>") -> Module | None:
    """Like :func:`parse_module`, but None where the text does not parse."""
    try:
        return parse_module(text, file)
    except ParseError:
        return None
