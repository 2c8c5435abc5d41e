"""Causes that point at the line: the audited module's source, read with inspect and ast,
for the classic attention bugs a behaviour (a leak, a NaN, a wrong output) can come from.

find_suspects(module) reads the source of every class in the module's tree (once per class)
and returns Suspects: a kind, the file and line, and a sentence naming the fix. The
properties ask for the kinds consistent with what they observed (`explain`), so a report
never advises about a masked_fill the module does not have.

Kinds: masked_fill_discarded, softmax_dim, dropout_before_softmax, mask_offset (triu with
diagonal >= 2, or tril with diagonal >= 1: future tokens visible), merge_without_transpose,
split_without_transpose, sdpa_inverted_mask, sdpa_not_causal, sdpa_dropout_always (dropout_p
not tied to self.training), float_mask (a 0/1 float triangle given as attn_mask: added to
the scores, not hiding them), mask_condition_off (the mask built under `if self.flag:` with
the flag off on this module), token_reduction (a mean/std/sum over a dimension other than
the last); and the facts source_read (a class whose source was read), uses_masked_fill,
uses_sdpa, uses_sdpa_mask (SDPA given an attn_mask), uses_softmax, uses_positions (rotary
or other positions computed in the forward).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

from torch import nn


@dataclass(frozen=True)
class Suspect:
    """One line of the module's source that can cause a bug of `kind`."""

    kind: str
    file: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.text} ({self.file}:{self.line})"


def find_suspects(module: nn.Module) -> list[Suspect]:
    """Suspect lines in the source of the classes of `module` and its submodules (those
    outside torch); none when the source cannot be read."""
    found: list[Suspect] = []
    seen: set[type] = set()
    for sub in module.modules():
        for cls in type(sub).__mro__:  # the classes it inherits its forward from, too
            if cls in seen or not issubclass(cls, nn.Module) or _outside(cls):
                continue
            seen.add(cls)
            found += _class_suspects(cls, sub)
    return found


# the kinds that leave the future visible: causes of a leak, and of nothing else
MASK_KINDS = (
    "mask_condition_off",
    "float_mask",
    "masked_fill_discarded",
    "sdpa_inverted_mask",
    "sdpa_not_causal",
    "mask_offset",
)
BUG_KINDS = (
    *MASK_KINDS,
    "softmax_dim",
    "dropout_before_softmax",
    "merge_without_transpose",
    "split_without_transpose",
    "token_reduction",
)


def _outside(cls: type) -> bool:
    """torch's own classes and transformers' (their source is not the user's)."""
    return cls.__module__.split(".")[0] in ("torch", "transformers", "builtins")


def explain(suspects: list[Suspect], kinds: tuple[str, ...]) -> list[str]:
    """The sentences of the suspects of those kinds, in the order of `kinds`; one sentence
    found on several lines is said once, with every line: "... (model.py:12, 13, 14)"."""
    lines: dict[tuple[str, str], list[int]] = {}  # (text, file) -> lines, in first-seen order
    for kind in kinds:
        for suspect in suspects:
            if suspect.kind == kind:
                lines.setdefault((suspect.text, suspect.file), []).append(suspect.line)
    return [f"{text} ({file}:{', '.join(map(str, at))})" for (text, file), at in lines.items()]


def has(suspects: list[Suspect], kind: str) -> bool:
    """Whether the source holds a suspect of `kind` (e.g. uses_masked_fill)."""
    return any(s.kind == kind for s in suspects)


def mask_convention(module: nn.Module, name: str) -> str | None:
    """How the module's forward reads its mask argument `name`, from its source:
    "blocked" (`masked_fill(mask, ...)`, `where(mask, fill, scores)`: True where a key is
    hidden), "allowed" (`masked_fill(~mask, ...)`, `mask == 0`, `where(mask, scores,
    fill)`: True where it is seen), "additive" (added to the scores); None when the source
    cannot be read or does not say (SDPA's attn_mask takes either an additive float or an
    allowed bool)."""
    tree = _forward_tree(type(module))
    if tree is None:
        return None
    aliases = {name: False}  # names holding the mask -> whether they hold it negated
    nodes = sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.Call | ast.BinOp)),
        key=lambda n: (n.lineno, n.col_offset),
    )
    for node in nodes:
        if isinstance(node, ast.Assign):
            held = _held(node.value, aliases)
            for target in node.targets:
                if isinstance(target, ast.Name):
                    if held is None:
                        aliases.pop(target.id, None)
                    else:
                        aliases[target.id] = held
            continue
        if isinstance(node, ast.BinOp):
            operands = (node.left, node.right)
            if isinstance(node.op, ast.Add) and any(_held(o, aliases) is False for o in operands):
                return "additive"
            continue
        method = _method(node)
        if method in ("masked_fill", "masked_fill_"):
            selector = node.args[0] if node.args else _keyword(node, "mask")
            held = None if selector is None else _held(selector, aliases)
            if held is not None:
                return "allowed" if held else "blocked"
        if method == "where" and len(node.args) == 3:
            held = _held(node.args[0], aliases)
            if held is not None and (_is_fill(node.args[1]) or _is_fill(node.args[2])):
                hides = _is_fill(node.args[1]) != held  # where(mask, fill, ...) hides
                return "blocked" if hides else "allowed"
    return None


def _forward_tree(cls: type) -> ast.AST | None:
    """The ast of the forward the class runs (its own or a base's, outside torch)."""
    for base in cls.__mro__:
        forward = vars(base).get("forward")
        if forward is None:
            continue
        if base.__module__.split(".")[0] == "torch":
            return None
        try:
            return ast.parse(textwrap.dedent(inspect.getsource(forward)))
        except (OSError, TypeError, SyntaxError, IndentationError):
            return None
    return None


def _held(expr: ast.expr, aliases: dict[str, bool]) -> bool | None:
    """Whether expr holds one of the mask's aliases negated (True) or as it is (False);
    None when it holds none (a slice, .bool() or .to() keep the polarity; ~, not,
    logical_not, == 0 and != 1 flip it)."""
    if isinstance(expr, ast.Name):
        return aliases.get(expr.id)
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Invert | ast.Not):
        inner = _held(expr.operand, aliases)
        return None if inner is None else not inner
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1:
        inner = _held(expr.left, aliases)
        other = expr.comparators[0]
        constant = other.value if isinstance(other, ast.Constant) else None
        if inner is None or isinstance(constant, str) or constant is None:
            return None
        flips = (isinstance(expr.ops[0], ast.Eq) and constant == 0) or (
            isinstance(expr.ops[0], ast.NotEq) and constant == 1
        )
        return not inner if flips else inner
    if isinstance(expr, ast.Subscript):
        return _held(expr.value, aliases)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
        if expr.func.attr == "logical_not":
            inner = _held(expr.func.value, aliases)
            return None if inner is None else not inner
        if expr.func.attr in ("bool", "to", "type_as", "contiguous", "view", "reshape"):
            return _held(expr.func.value, aliases)
    if isinstance(expr, ast.Call) and _method(expr) == "logical_not" and expr.args:
        inner = _held(expr.args[0], aliases)
        return None if inner is None else not inner
    return None


def _is_fill(expr: ast.expr) -> bool:
    """A masking fill: -inf, a finfo minimum, a negative constant."""
    text = ast.unparse(expr)
    if "inf" in text or "finfo" in text:
        return True
    return isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub)


def _class_suspects(cls: type, instance: nn.Module) -> list[Suspect]:
    found = _class_source(cls)
    if found is None:
        return []  # defined in a REPL, compiled, or not Python source
    tree, file, start = found
    where = _short(file)
    visitor = _Visitor(where, start - 1, instance)
    visitor.visit(tree)
    return [Suspect("source_read", where, start, cls.__name__), *visitor.found]


@functools.lru_cache(maxsize=256)
def _class_source(cls: type) -> tuple[ast.AST, str, int] | None:
    """(the class's ast, its file, its first line), read once per class: an audit asks
    several times (the causes of a leak, of a mismatch, of a NaN), and finding a class in a
    long file (x-transformers' 3000 lines) takes a second each time."""
    try:
        lines, start = inspect.getsourcelines(cls)
        file = inspect.getsourcefile(cls) or "<unknown>"
        return ast.parse(textwrap.dedent("".join(lines))), file, start
    except (OSError, TypeError, SyntaxError, IndentationError):
        return _class_from_forward(cls)  # a file imported outside sys.modules (the CLI)


def _class_from_forward(cls: type) -> tuple[ast.AST, str, int] | None:
    """(the class's ast, its file, its first line) found through its forward's code object,
    for a class whose module is not in sys.modules."""
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    if code is None:
        return None
    try:
        tree = ast.parse(Path(code.co_filename).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node, code.co_filename, 1  # ast lines are the file's: offset 0
    return None


def _short(file: str) -> str:
    path = Path(file)
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return path.name


_DROPOUT_NAMES = ("dropout", "drop")
_TEXTS = {
    "masked_fill_discarded": "masked_fill without the trailing underscore returns a new "
    "tensor and this line throws it away: use masked_fill_, or assign the result",
    "dropout_before_softmax": "dropout is applied to the scores before the softmax (a "
    "dropped -inf becomes NaN, and the weights no longer sum to 1): apply it to the "
    "attention weights after the softmax",
    "sdpa_inverted_mask": "the mask is inverted: the boolean attn_mask given to "
    "F.scaled_dot_product_attention is built from triu (True on the future), but SDPA reads "
    "True as 'may attend': pass ~mask, or is_causal=True",
    "sdpa_not_causal": "F.scaled_dot_product_attention is called without is_causal=True "
    "and without an attn_mask: nothing hides the future",
    "merge_without_transpose": "the heads are merged with view/reshape straight from "
    "(b, heads, tokens, head_dim), without transpose(1, 2) back to (b, tokens, heads, "
    "head_dim) first",
    "split_without_transpose": "the heads are split with view(b, heads, tokens, head_dim): "
    "use view(b, tokens, heads, head_dim).transpose(1, 2)",
    "sdpa_dropout_always": "F.scaled_dot_product_attention gets dropout_p in eval mode too: "
    "pass dropout_p=self.dropout if self.training else 0.0",
    "float_mask": "attn_mask is a float 0/1 triangle (triu/tril of ones): a float mask is "
    "ADDED to the scores, so the future gets +1 instead of -inf: use a boolean mask "
    "(dtype=torch.bool, True where a query may attend) or fill the blocked part with -inf",
}
_REDUCTIONS = ("mean", "std", "var", "sum", "norm", "amax", "amin", "logsumexp", "cumsum")
_MASKING = {"masked_fill", "masked_fill_", "triu", "tril", "where", "scaled_dot_product_attention"}


def _positional(method: str) -> bool:
    """A call that applies positions: rope/rotary helpers, ALiBi, sin and cos tables."""
    lowered = method.lower()
    return any(w in lowered for w in ("rope", "rotary", "rotate", "alibi")) or lowered in (
        "sin",
        "cos",
        "polar",
        "view_as_complex",
    )


def _float_triangle(node: ast.AST) -> bool:
    """triu/tril of ones (or ones_like) without a bool dtype or a -inf fill."""
    calls = {_method(c) for c in ast.walk(node) if isinstance(c, ast.Call)}
    text = ast.unparse(node)
    bool_like = "bool" in text or "inf" in text or "finfo" in text or "masked_fill" in calls
    return bool(calls & {"triu", "tril"}) and bool(calls & {"ones", "ones_like"}) and not bool_like


class _Visitor(ast.NodeVisitor):
    """Walks a class's source in order, noting suspect calls and statements."""

    def __init__(self, file: str, offset: int, instance: nn.Module | None = None) -> None:
        self.file, self.offset, self.instance = file, offset, instance
        self.float_names: set[str] = set()  # names holding a float 0/1 triangle
        self.found: list[Suspect] = []
        self.dropped: dict[str, int] = {}  # names assigned from a dropout of the scores
        self.triu_names: set[str] = set()  # names (self.x too) holding a triu mask
        self.head_outputs: set[str] = set()  # names holding weights @ values, untransposed

    def add(self, kind: str, node: ast.AST, text: str | None = None) -> None:
        self.found.append(Suspect(kind, self.file, node.lineno + self.offset, text or _TEXTS[kind]))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.dropped = {}
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Call) and _method(node.value) == "masked_fill":
            self.add("masked_fill_discarded", node)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)  # the value reads the names as they were before
        self._note_assignment(node.targets, node.value)

    def _note_assignment(self, targets: list[ast.expr], value: ast.expr) -> None:
        names = [_name(t) for t in targets]
        calls = [_method(c) for c in ast.walk(value) if isinstance(c, ast.Call)]
        if any(_is_dropout(c) for c in calls) and "softmax" not in calls:
            self.dropped.update({n: value.lineno for n in names if n})
        else:
            for n in names:
                self.dropped.pop(n, None)
        if "triu" in calls:
            self.triu_names.update(n for n in names if n)
        if _float_triangle(value):
            self.float_names.update(n for n in names if n)
        else:
            self.float_names.difference_update(names)
        transposed = any(c in ("transpose", "permute", "movedim", "swapaxes") for c in calls)
        attended = _is_matmul(value) or "scaled_dot_product_attention" in calls
        for n in names:
            self.head_outputs.discard(n)
            if n and attended and not transposed:
                self.head_outputs.add(n)

    def visit_Call(self, node: ast.Call) -> None:
        method = _method(node)
        if method == "register_buffer" and len(node.args) >= 2:
            calls = [_method(c) for c in ast.walk(node.args[1]) if isinstance(c, ast.Call)]
            if "triu" in calls and isinstance(node.args[0], ast.Constant):
                self.triu_names.add(f"self.{node.args[0].value}")
        if method in ("triu", "tril"):
            self._mask_offset(node, method)
        elif method == "softmax":
            self._softmax(node)
        elif method in ("view", "reshape"):
            self._reshape(node)
        elif method == "scaled_dot_product_attention":
            self._sdpa(node)
        elif method in _REDUCTIONS:
            self._reduction(node, method)
        elif method in ("masked_fill", "masked_fill_"):
            self.add("uses_masked_fill", node, "masked_fill")
        if method in ("scaled_dot_product_attention", "multi_head_attention_forward"):
            self._float_mask(node)
        if method == "softmax":
            self.add("uses_softmax", node, "softmax")
        if _positional(method):
            self.add("uses_positions", node, f"{method}(...)")
        if method == "scaled_dot_product_attention":
            self.add("uses_sdpa", node, "scaled_dot_product_attention")
        self.generic_visit(node)

    def _mask_offset(self, node: ast.Call, method: str) -> None:
        diagonal = _keyword(node, "diagonal")
        if diagonal is None and len(node.args) >= 2:
            diagonal = node.args[1]
        value = _int(diagonal) if diagonal is not None else 0
        if value is None:
            return
        visible = value - 1 if method == "triu" else value  # future tokens each query sees
        if visible >= 1:
            text = (
                f"{method}(..., diagonal={value}) lets each query see {visible} future "
                f"token{'s' if visible > 1 else ''}: the causal mask is triu(..., diagonal=1) "
                f"(or tril(..., diagonal=0) for the allowed part)"
            )
            self.add("mask_offset", node, text)

    def _softmax(self, node: ast.Call) -> None:
        dim = _keyword(node, "dim")
        if dim is None and len(node.args) >= 2:
            dim = node.args[1]
        value = _int(dim) if dim is not None else None
        if value is not None and value != -1:
            text = (
                f"softmax over dim={value}: the attention weights are normalised over the "
                f"keys, the last dimension (dim=-1)"
            )
            self.add("softmax_dim", node, text)
        inside = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        inside |= {_name(n) for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        for name in inside & set(self.dropped):
            line = self.dropped[name] + self.offset
            self.found.append(
                Suspect("dropout_before_softmax", self.file, line, _TEXTS["dropout_before_softmax"])
            )
        calls = [_method(c) for c in ast.walk(node) if isinstance(c, ast.Call) and c is not node]
        if any(_is_dropout(c) for c in calls):
            self.add("dropout_before_softmax", node)

    def _reshape(self, node: ast.Call) -> None:
        receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
        split = len(node.args) == 4 and not getattr(node, "_then_transposed", False)
        shapes = [ast.unparse(a) for a in node.args]
        # (1, heads, 1, 1) broadcasts a per-head value; (b, heads, t, t) shapes scores
        split = split and "1" not in shapes and shapes[2] != shapes[3]
        if split and _mentions_heads(node.args[1]):
            self.add("split_without_transpose", node)
        while isinstance(receiver, ast.Call) and _method(receiver) == "contiguous":
            receiver = receiver.func.value  # type: ignore[union-attr]
        untransposed = _is_matmul(receiver) or _name(receiver) in self.head_outputs
        if len(node.args) == 3 and untransposed:
            self.add("merge_without_transpose", node)

    def visit_If(self, node: ast.If) -> None:
        """A mask built only under `if self.flag:` (or `if not self.flag:`) whose flag is
        off on the audited instance."""
        test, negated = node.test, False
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, negated = test.operand, True
        name = _name(test)
        if name.startswith("self.") and self.instance is not None:
            flag = name.removeprefix("self.")
            value = getattr(self.instance, flag, None)
            calls = {_method(c) for n in node.body for c in ast.walk(n) if isinstance(c, ast.Call)}
            if calls & _MASKING and isinstance(value, bool) and value == negated:
                text = (
                    f"the causal mask is built only under `if {'not ' if negated else ''}"
                    f"{name}:` and {flag} is {value} on this module: construct it with "
                    f"{flag}={not value}, or mask unconditionally"
                )
                self.add("mask_condition_off", node, text)
        self.generic_visit(node)

    def _reduction(self, node: ast.Call, method: str) -> None:
        dim = _keyword(node, "dim")
        if dim is None and node.args and isinstance(node.func, ast.Attribute):
            dim = node.args[0]  # x.mean(1)
        value = _int(dim) if dim is not None else None
        if value is not None and value != -1:
            text = (
                f"{ast.unparse(node)[:60]} reduces over dim={value}: if that is the token "
                f"axis, every position sees a statistic of the whole sequence, the future "
                f"included (normalise over the last dimension, or per position)"
            )
            self.add("token_reduction", node, text)

    def _float_mask(self, node: ast.Call) -> None:
        mask = _keyword(node, "attn_mask")
        if mask is None:
            return
        self.add("uses_sdpa_mask", node, "attn_mask")
        names = {_name(n) for n in ast.walk(mask) if isinstance(n, ast.Name | ast.Attribute)}
        if _float_triangle(mask) or names & self.float_names:
            self.add("float_mask", node, _TEXTS["float_mask"])

    def _sdpa(self, node: ast.Call) -> None:
        dropout = _keyword(node, "dropout_p")
        mentions = (
            {n.id for n in ast.walk(dropout) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(dropout) if isinstance(n, ast.Attribute)}
            if dropout is not None
            else set()
        )
        constant = isinstance(dropout, ast.Constant)
        if dropout is not None and not constant and "training" not in mentions:
            self.add("sdpa_dropout_always", node)
        mask = _keyword(node, "attn_mask")
        if mask is None and len(node.args) >= 4:
            mask = node.args[3]
        causal = _keyword(node, "is_causal")
        if mask is None or (isinstance(mask, ast.Constant) and mask.value is None):
            if causal is None or (isinstance(causal, ast.Constant) and not causal.value):
                self.add("sdpa_not_causal", node)
            return
        negated = any(
            isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Invert | ast.Not)
            for n in ast.walk(mask)
        ) or any(
            isinstance(c, ast.Call) and _method(c) in ("logical_not", "tril")
            for c in ast.walk(mask)
        )
        names = {_name(n) for n in ast.walk(mask) if isinstance(n, ast.Name | ast.Attribute)}
        calls = {_method(c) for c in ast.walk(mask) if isinstance(c, ast.Call)}
        if not negated and ("triu" in calls or names & self.triu_names):
            self.add("sdpa_inverted_mask", node)

    def generic_visit(self, node: ast.AST) -> None:
        # mark view/reshape calls whose result is transposed right away: x.view(...).transpose
        if isinstance(node, ast.Call) and _method(node) in ("transpose", "permute"):
            receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
            if isinstance(receiver, ast.Call) and _method(receiver) in ("view", "reshape"):
                receiver._then_transposed = True  # type: ignore[attr-defined]
        super().generic_visit(node)


def _method(call: ast.Call) -> str:
    """The called name: `softmax` for torch.softmax(...), x.softmax(...), F.softmax(...)."""
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _is_dropout(name: str) -> bool:
    return any(part in name.lower() for part in _DROPOUT_NAMES)


def _is_matmul(node: ast.AST | None) -> bool:
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult)


def _name(node: ast.AST) -> str:
    """'x' for x, 'self.mask' for self.mask; '' for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return ""


def _mentions_heads(node: ast.AST) -> bool:
    names = {_name(n) for n in ast.walk(node)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }
    return any("head" in n.lower() or n in ("h", "nh") for n in names if n)


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _int(node: ast.expr) -> int | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
    ):
        return -node.operand.value
    return None
