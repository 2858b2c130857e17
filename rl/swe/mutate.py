"""Bugs synthesised into real source files (SWE-smith's procedural modifications, at small scale).

Families: swe_repair's (a flipped comparison, a wrong arithmetic operator, an off-by-one range
bound, an int constant + 1, and/or swapped, True/False swapped, a swapped call such as
min/max or startswith/endswith), plus two of SWE-smith's that need real code: an `if`
condition negated, and a `return` value dropped (`return None` where a value was returned).

A mutant is the file's own text with one expression (or statement) replaced by its mutated
unparse, so the bug is a one-line diff and the rest of the file (comments, formatting) is
untouched. Sites are taken in the file's order; `mutants` yields each once.
"""
from __future__ import annotations

import ast
from typing import Iterator

_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv,
        ast.Div: ast.Mult}
_SYM = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Add: "+",
        ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%", ast.Div: "/"}
_SWAP = {"min": "max", "max": "min", "any": "all", "all": "any", "upper": "lower", "lower": "upper",
         "startswith": "endswith", "endswith": "startswith", "append": "insert", "sort": "reverse"}
MUTATIONS = ("comparison", "operator", "range", "constant", "boolop", "bool", "call")
FAMILIES = (*MUTATIONS, "negate_if", "drop_return")


def sites(tree: ast.AST) -> Iterator[tuple[str, ast.AST, int]]:
    """(kind, node, sub-index) of every mutable site, in ast.walk order (deterministic)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _CMP:
                    yield "comparison", node, i
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _BIN:
            yield "operator", node, 0
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"
              and 1 <= len(node.args) <= 3 and not node.keywords):
            yield "range", node, 0                           # stop - 1
            if len(node.args) >= 2:
                yield "range", node, 1                       # start + 1
        elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 1000:
            yield "constant", node, 0
        elif isinstance(node, ast.BoolOp):
            yield "boolop", node, 0
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            yield "bool", node, 0
        if isinstance(node, ast.Call) and not node.keywords:
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in _SWAP and (name != "append" or len(node.args) == 1) and (name != "sort" or not node.args):
                yield "call", node, 0


def _minus_one(e: ast.expr) -> ast.expr:
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add) and isinstance(e.right, ast.Constant) and e.right.value == 1:
        return e.left                                        # range(1, n + 1) -> range(1, n)
    if isinstance(e, ast.Constant) and type(e.value) is int:
        return ast.Constant(e.value - 1)
    return ast.BinOp(e, ast.Sub(), ast.Constant(1))


def _plus_one(e: ast.expr) -> ast.expr:
    if isinstance(e, ast.Constant) and type(e.value) is int:
        return ast.Constant(e.value + 1)
    return ast.BinOp(e, ast.Add(), ast.Constant(1))


def apply_mutation(kind: str, node: ast.AST, sub: int) -> str:
    """Mutate one site of sites in place; returns its description."""
    line = getattr(node, "lineno", 0)
    if kind == "comparison":
        old = node.ops[sub]
        node.ops[sub] = _CMP[type(old)]()
        desc = f"{_SYM[type(old)]} -> {_SYM[_CMP[type(old)]]}"
    elif kind == "operator":
        old = node.op
        node.op = _BIN[type(old)]()
        desc = f"{_SYM[type(old)]} -> {_SYM[_BIN[type(old)]]}"
    elif kind == "range":
        stop = 0 if len(node.args) == 1 else 1
        if sub == 0:
            node.args[stop] = _minus_one(node.args[stop])
            desc = "range stop - 1"
        else:
            node.args[0] = _plus_one(node.args[0])
            desc = "range start + 1"
    elif kind == "constant":
        desc = f"{node.value} -> {node.value + 1}"
        node.value += 1
    elif kind == "boolop":
        desc = "and -> or" if isinstance(node.op, ast.And) else "or -> and"
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind == "bool":
        desc = f"{node.value} -> {not node.value}"
        node.value = not node.value
    else:
        f = node.func
        old = f.id if isinstance(f, ast.Name) else f.attr
        new = _SWAP[old]
        if new == "insert":                                  # xs.append(v) -> xs.insert(0, v)
            node.args.insert(0, ast.Constant(0))
        if isinstance(f, ast.Name):
            f.id = new
        else:
            f.attr = new
        desc = f"{old}() -> {new}()"
    return f"{kind} {desc} (line {line})"




def _all_sites(tree: ast.AST) -> list[tuple[str, ast.AST, int]]:
    out = list(sites(tree))
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While)) and not isinstance(node.test, ast.Constant):
            out.append(("negate_if", node, 0))
        elif isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            out.append(("drop_return", node, 0))
    return sorted(out, key=lambda s: (_target(s).lineno, _target(s).col_offset, s[0], s[2]))


def _target(site: tuple[str, ast.AST, int]) -> ast.AST:
    """The node whose text a mutation replaces."""
    kind, node, _ = site
    return node.test if kind == "negate_if" else node.value if kind == "drop_return" else node


def _mutate(site: tuple[str, ast.AST, int]) -> str:
    """Apply one site's mutation in place; its description."""
    kind, node, sub = site
    if kind == "negate_if":
        node.test = ast.UnaryOp(ast.Not(), node.test)
        return f"negate_if (line {node.lineno})"
    if kind == "drop_return":
        node.value = ast.Constant(None)
        return f"drop_return (line {node.lineno})"
    return apply_mutation(kind, node, sub)


def count(text: str) -> int:
    """How many mutable sites a module has (0 when it does not parse)."""
    try:
        return len(_all_sites(ast.parse(text)))
    except SyntaxError:
        return 0


def mutant(text: str, i: int) -> tuple[str, str, int] | None:
    """(mutated text, description, line) of site i, or None when no text edit gives that tree."""
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    site = _all_sites(tree)[i]
    target = _target(site)
    r0, c0, r1, c1 = target.lineno - 1, target.col_offset, target.end_lineno - 1, target.end_col_offset
    desc = _mutate(site)
    expected = ast.dump(tree)
    new = _target(site)
    first, last = lines[r0].encode(), lines[r1].encode()     # offsets are UTF-8 bytes of the line
    for replacement in (ast.unparse(new), f"({ast.unparse(new)})"):
        out = "".join(lines[:r0]) + first[:c0].decode() + replacement + last[c1:].decode() + "".join(lines[r1 + 1:])
        try:
            if ast.dump(ast.parse(out)) == expected:         # the text parses to the mutated tree
                return out, desc, target.lineno
        except SyntaxError:
            continue
    return None


def mutants(text: str) -> Iterator[tuple[str, str, int]]:
    """(mutated text, description, line) of every mutable site of a module, in order."""
    for i in range(count(text)):
        m = mutant(text, i)
        if m is not None:
            yield m
