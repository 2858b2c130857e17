"""The tools the chat format declares and the environments run: the calculator (+ - * / and
parentheses, parsed with ast, never eval) and search_docs over the docstrings of local
standard-library modules (read with ast, nothing imported)."""
from __future__ import annotations

import ast
import operator
import sysconfig
from dataclasses import dataclass
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Small, pure-Python modules with documented top-level functions (the docs-tool corpus and the
# code tasks). Missing ones (another Python version) are skipped.
DOC_MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "base64", "heapq", "bisect", "statistics",
               "difflib", "calendar", "colorsys", "glob", "string", "html/__init__", "json/__init__",
               "keyword", "copy", "quopri", "uu", "imghdr", "sndhdr", "random", "shutil", "tempfile",
               "urllib/parse", "email/utils", "tokenize", "linecache", "ntpath", "genericpath")

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SEARCH_DOCS = {"type": "function", "function": {
    "name": "search_docs", "description": "Look up the docstring of a Python standard-library function by "
                                          "its dotted name (module.function) or bare function name.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
MAX_DOC_CHARS = 600      # search_docs returns at most this much of a docstring


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    raise ValueError(f"unsupported expression element {ast.dump(node)[:60]}")


def format_number(v: float) -> str:
    """Integers without a decimal point, others to 6 significant digits (what the tool prints)."""
    if abs(v - round(v)) < 1e-9:
        return str(int(round(v)))
    return f"{v:.6g}"


def calculator(expression: str) -> str:
    """The calculator tool: + - * / and parentheses on numbers, evaluated for real (no eval())."""
    try:
        tree = ast.parse(expression.replace(",", ""), mode="eval")
        return format_number(_eval(tree))
    except (SyntaxError, ZeroDivisionError, ValueError, OverflowError) as e:
        raise ValueError(f"calculator cannot evaluate {expression!r}: {e}") from None
    except RecursionError:      # thousands of chained terms: the parser's or _eval's depth
        raise ValueError(f"calculator cannot evaluate {expression[:40]!r}...: nested too deeply") from None


def same_number(a: str, b: str) -> bool:
    """Two numbers written as text (commas ignored) equal within a relative 1e-6; False when
    either is not a number."""
    try:
        x, y = float(a.replace(",", "")), float(b.replace(",", ""))
    except ValueError:
        return False
    return abs(x - y) <= 1e-6 * max(1.0, abs(x))


@dataclass(frozen=True)
class Function:
    name: str          # module.function
    signature: str     # function(args)
    doc: str
    source: str


def stdlib_functions(modules: tuple[str, ...] = DOC_MODULES) -> list[Function]:
    """Documented public top-level functions of the modules, read with ast (never imported)."""
    out = []
    for m in modules:
        path = STDLIB / f"{m}.py"
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        mod = m.removesuffix("/__init__").replace("/", ".")
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                src = ast.get_source_segment(text, node)
                if doc and src and len(doc) >= 20:
                    out.append(Function(f"{mod}.{node.name}", f"{node.name}({ast.unparse(node.args)})", doc, src))
    return out


class DocIndex:
    """The search_docs tool over a local docstring corpus."""

    def __init__(self, functions: list[Function], max_chars: int):
        self.by_name = {f.name: f for f in functions}
        self.max_chars = max_chars

    def search(self, query: str) -> str:
        q = query.strip()
        hits = [self.by_name[q]] if q in self.by_name else [f for n, f in self.by_name.items()
                                                             if n.rsplit(".", 1)[1] == q]
        if not hits:
            return f"No documentation found for {q!r}."
        return "\n\n".join(f"{f.name}{f.signature[f.signature.index('('):]}\n{f.doc[: self.max_chars]}"
                           for f in hits[:3])
