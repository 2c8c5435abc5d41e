"""One-line mutants of the call plan's allow-list and of the interop weight copies, each run
against the tests that must notice it (issue 37, item 17: "tests that do not notice").

What is mutated, one mutant at a time:

- src/attnlab/plan.py, every condition, found in its syntax tree (so the list follows the
  code as it changes): each operand of an `and`/`or` dropped; each condition negated (a
  comparison by its opposite operator, `not x` by `x`, anything else by `not (...)`); each
  ordering comparison moved by one (`<` <-> `<=`, `>` <-> `>=`); each early `return None`,
  `return False` or `return None, None` under an `if` deleted (`pass`).
- the weight copies of the swaps and conversions (interop/nanogpt.py, llama.py, book.py,
  hf.py's from_/to_ conversions, qkv.py), written out below (COPIES): q/k/v rows or chunks
  reordered, a weight or bias copy dropped, a square weight transposed. Each names the text
  it replaces; text no longer in the file is reported "stale" (the list needs updating).

For each mutant the target file is rewritten, the target's tests run (`pytest -x -q`, a
fixed list of files per target, TARGETS, with a per-mutant timeout) and the file is restored
whatever happens (try/finally; SIGTERM and SIGINT stop the runs in progress first; its
bytes and its mtime, so that no bytecode cached for a mutant is taken for the original).
The run happens in scratch copies of the checkout (tracked and untracked, non-ignored
files), so tests others run in the checkout meanwhile never see a mutant; a target file
with uncommitted changes is refused, or, with --head, the copies take every tracked file as
committed at HEAD (resolved once; edits in progress left out, untracked files such as new
tests as they are). --in-place mutates the checkout itself (one at a time). The tests first
run on the unmutated code: a failure there stops the run. pytest runs in a child forked
from a server that imported torch, dynamo, transformers and pytest once (attnlab and the
tests are imported afresh in each child): ~1 s of start instead of ~7 (--no-fork: a new
interpreter each time).

A mutant listed in EQUIVALENT changes no behaviour (the reason is given); it is run too and
reported as equivalent, not as a survivor (or as "listed equivalent but killed": the list
is wrong). Output: one line per mutant as it finishes, then a table (mutant, killed /
survived / equivalent, the killing test or the reason) and the counts; exit status 1 when
a mutant survived, a listed one was killed, or a COPIES text is stale.

Usage (from the repository root):

    .venv/bin/python scripts/mutants.py --list                 # the mutants, none run
    .venv/bin/python scripts/mutants.py --jobs 2               # all, two at a time
    .venv/bin/python scripts/mutants.py -k native_module       # those whose id holds it
    nohup .venv/bin/python scripts/mutants.py --head --jobs 2 > mutants.log 2>&1 &

Runtime: `--head --jobs 2` on a 2-core machine shared with other test runs (load average
4 to 9), all 226 mutants of b1246ee: 21.7 minutes (221 killed, 5 equivalent), the two
baselines included (~1.5 minutes). A killed mutant costs 3-10 s (its tests until the
first failure, pytest's start ~1 s); a survivor or an equivalent runs its whole list (plan:
~40 s on a quiet machine, ~2 minutes under load; interop: ~15 s). With --no-fork, add ~7 s
per mutant (about 15 minutes more on two jobs).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300  # seconds per mutant; a mutant that hangs the tests counts as killed

PLAN = "src/attnlab/plan.py"
PLAN_TESTS = (
    "tests/test_plan_conditions.py",
    "tests/test_plan.py",
    "tests/test_decode_cpu.py",
    "tests/test_matvec.py",
    "tests/test_plan_differential.py",
    "tests/test_plan_lane.py",
)
# a subprocess rebuilding the kernel with other flags (22 s): the plan is the same there
PLAN_DESELECT = ("tests/test_decode_cpu.py::test_the_avx2_build_passes_the_native_tests_too",)
INTEROP_TESTS = (
    "tests/interop/test_weight_copies.py",
    "tests/interop/test_nanogpt.py",
    "tests/interop/test_llama.py",
    "tests/interop/test_swap.py",
    "tests/interop/test_book.py",
    "tests/test_qkv.py",
    "tests/interop/test_hf.py::test_gpt2_attention_converts_both_ways",
    "tests/interop/test_hf.py::test_llama_attention_converts_both_ways",
    "tests/interop/test_hf.py::test_conversion_errors",
    # Qwen3, Gemma 3, OLMo 2 and scaled Llamas, norms moved off their start, there and back
    "tests/interop/test_hf.py::test_open_layers_convert_back_to_the_same_weights",
)
TARGETS = {
    PLAN: (PLAN_TESTS, PLAN_DESELECT),
    "src/attnlab/interop/nanogpt.py": (INTEROP_TESTS, ()),
    "src/attnlab/interop/llama.py": (INTEROP_TESTS, ()),
    "src/attnlab/interop/book.py": (INTEROP_TESTS, ()),
    "src/attnlab/interop/hf.py": (INTEROP_TESTS, ()),
    "src/attnlab/qkv.py": (INTEROP_TESTS, ()),
}

# The weight copies: (file, function, text, replacement, what it does). The text must occur
# exactly once in the function.
NANOGPT, LLAMA, BOOK, HF, QKV = (
    "src/attnlab/interop/nanogpt.py",
    "src/attnlab/interop/llama.py",
    "src/attnlab/interop/book.py",
    "src/attnlab/interop/hf.py",
    "src/attnlab/qkv.py",
)
_QKV_LOAD = "attention.qkv_proj.load_state_dict(c_attn.state_dict())"
_OUT_LOAD = "attention.out_proj.load_state_dict(c_proj.state_dict())"
COPIES = (
    (
        NANOGPT,
        "from_nanogpt_attention",
        _QKV_LOAD,
        "attention.qkv_proj.load_state_dict({n: torch.cat(t.chunk(3)[::-1]) "
        "for n, t in c_attn.state_dict().items()})",
        "q/k/v row chunks reversed",
    ),
    (
        NANOGPT,
        "from_nanogpt_attention",
        _QKV_LOAD,
        "attention.qkv_proj.load_state_dict({n: torch.cat([t.chunk(3)[i] for i in (0, 2, 1)]) "
        "for n, t in c_attn.state_dict().items()})",
        "k and v row chunks swapped",
    ),
    (NANOGPT, "from_nanogpt_attention", _QKV_LOAD, "pass", "c_attn copy dropped"),
    (
        NANOGPT,
        "from_nanogpt_attention",
        _QKV_LOAD,
        "attention.qkv_proj.weight.copy_(c_attn.weight)",
        "c_attn's bias not copied",
    ),
    (NANOGPT, "from_nanogpt_attention", _OUT_LOAD, "pass", "c_proj copy dropped"),
    (
        NANOGPT,
        "from_nanogpt_attention",
        _OUT_LOAD,
        "attention.out_proj.weight.copy_(c_proj.weight)",
        "c_proj's bias not copied",
    ),
    (
        NANOGPT,
        "from_nanogpt_attention",
        _OUT_LOAD,
        "attention.out_proj.load_state_dict({n: t.T if t.dim() == 2 else t "
        "for n, t in c_proj.state_dict().items()})",
        "c_proj's weight transposed",
    ),
    (
        LLAMA,
        "from_llama_attention",
        "wrapper.load_state_dict(from_llama_state(layer.state_dict()))",
        "pass",
        "the layer's weights not loaded",
    ),
    (
        LLAMA,
        "from_llama_state",
        "torch.cat(parts)",
        "torch.cat([parts[0], parts[2], parts[1]])",
        "W_key and W_value rows swapped",
    ),
    (
        LLAMA,
        "from_llama_state",
        "torch.cat(parts)",
        "torch.cat(parts[::-1])",
        "q/k/v rows reversed",
    ),
    (
        LLAMA,
        "from_llama_state",
        'result.pop(f"{prefix}out_proj.weight")',
        'result.pop(f"{prefix}out_proj.weight").T',
        "out_proj's weight transposed",
    ),
    (
        LLAMA,
        "from_llama_state",
        'for what in ("weight", "bias"):',
        'for what in ("weight",):',
        "biases not fused",
    ),
    (
        LLAMA,
        "to_llama_state",
        "zip(_PROJECTIONS[:3], parts, strict=True)",
        'zip(("W_query", "W_value", "W_key"), parts, strict=True)',
        "W_key and W_value rows swapped",
    ),
    (
        LLAMA,
        "to_llama_state",
        'result[f"{prefix}out_proj.weight"] = out',
        'result[f"{prefix}out_proj.weight"] = out.T',
        "out_proj's weight transposed",
    ),
    (BOOK, "from_book", "module.load_state_dict(m.state_dict())", "pass", "weights not copied"),
    (
        BOOK,
        "to_book",
        "(result.W_query, result.W_key, result.W_value)",
        "(result.W_query, result.W_value, result.W_key)",
        "W_key and W_value swapped",
    ),
    (
        BOOK,
        "to_book",
        "layer.weight.copy_(_per_query_head(weight_rows, m, groups))",
        "pass",
        "a q/k/v weight copy dropped",
    ),
    (
        BOOK,
        "to_book",
        "layer.bias.copy_(_per_query_head(bias_rows, m, groups))",
        "pass",
        "a q/k/v bias copy dropped",
    ),
    (
        BOOK,
        "to_book",
        "result.out_proj.load_state_dict(m.out_proj.state_dict())",
        "result.out_proj.weight.copy_(m.out_proj.weight)",
        "out_proj's bias not copied",
    ),
    (
        BOOK,
        "to_book",
        "result.out_proj.load_state_dict(m.out_proj.state_dict())",
        "result.out_proj.weight.copy_(m.out_proj.weight.T)",
        "out_proj's weight transposed (and its bias not copied)",
    ),
    (
        BOOK,
        "_per_query_head",
        "heads.repeat_interleave(groups, dim=0)",
        "heads.repeat(groups, *[1] * (heads.dim() - 1))",
        "key/value heads tiled instead of repeated per query head",
    ),
    (
        HF,
        "from_gpt2_attention",
        "qkv.split_rows(rows, d, d) +",
        "qkv.split_rows(rows, d, d)[::-1] +",
        "q/k/v weight rows reversed",
    ),
    (
        HF,
        "from_gpt2_attention",
        "+ qkv.split_rows(layer.c_attn.bias, d, d)",
        "+ qkv.split_rows(layer.c_attn.bias, d, d)[::-1]",
        "q/k/v bias chunks reversed",
    ),
    (
        HF,
        "from_gpt2_attention",
        "module.out_proj.weight.copy_(layer.c_proj.weight.T)",
        "module.out_proj.weight.copy_(layer.c_proj.weight)",
        "c_proj's weight not transposed",
    ),
    (
        HF,
        "from_gpt2_attention",
        "module.out_proj.bias.copy_(layer.c_proj.bias)",
        "pass",
        "c_proj's bias not copied",
    ),
    (
        HF,
        "to_gpt2_attention",
        "qkv.fuse_rows(*w.weights)",
        "qkv.fuse_rows(*w.weights[::-1])",
        "q/k/v weight rows reversed",
    ),
    (
        HF,
        "to_gpt2_attention",
        "qkv.fuse_rows(*w.biases)",
        "qkv.fuse_rows(*w.biases[::-1])",
        "q/k/v bias chunks reversed",
    ),
    (
        HF,
        "to_gpt2_attention",
        "layer.c_attn.bias.copy_(qkv.fuse_rows(*w.biases))",
        "pass",
        "c_attn's bias not copied",
    ),
    (
        HF,
        "to_gpt2_attention",
        "layer.c_proj.weight.copy_(module.out_proj.weight.T)",
        "layer.c_proj.weight.copy_(module.out_proj.weight)",
        "out_proj's weight not transposed",
    ),
    (
        HF,
        "to_gpt2_attention",
        "layer.c_proj.bias.copy_(module.out_proj.bias)",
        "pass",
        "out_proj's bias not copied",
    ),
    (
        HF,
        "from_llama_attention",
        "projections = (layer.q_proj, layer.k_proj, layer.v_proj)",
        "projections = (layer.q_proj, layer.v_proj, layer.k_proj)",
        "k_proj and v_proj swapped",
    ),
    (
        HF,
        "from_llama_attention",
        "module.out_proj.weight.copy_(layer.o_proj.weight)",
        "module.out_proj.weight.copy_(layer.o_proj.weight.T)",
        "o_proj's weight transposed",
    ),
    (
        HF,
        "from_llama_attention",
        "module.out_proj.bias.copy_(o_bias if o_bias is not None else torch.zeros(width))",
        "module.out_proj.bias.zero_()",
        "o_proj's bias not copied",
    ),
    (
        HF,
        "from_llama_attention",
        "getattr(module, name).weight.copy_(_norm_weight(getattr(layer, name)))",
        "pass",
        "q_norm/k_norm weights not copied",
    ),
    (
        HF,
        "to_llama_attention",
        "projections = (layer.q_proj, layer.k_proj, layer.v_proj)",
        "projections = (layer.q_proj, layer.v_proj, layer.k_proj)",
        "k_proj and v_proj swapped",
    ),
    (
        HF,
        "to_llama_attention",
        "target.bias.copy_(bias)",
        "pass",
        "q/k/v bias copies dropped",
    ),
    (
        HF,
        "to_llama_attention",
        "layer.o_proj.weight.copy_(module.out_proj.weight)",
        "layer.o_proj.weight.copy_(module.out_proj.weight.T)",
        "o_proj's weight transposed",
    ),
    (
        HF,
        "to_llama_attention",
        "layer.o_proj.bias.copy_(module.out_proj.bias)",
        "pass",
        "o_proj's bias not copied",
    ),
    (
        HF,
        "to_llama_attention",
        "_norm_weight(getattr(layer, name)).copy_(getattr(module, name).weight)",
        "pass",
        "q_norm/k_norm weights not copied",
    ),
    (
        QKV,
        "split_rows",
        "tuple(fused.split([q_rows, kv_rows, kv_rows]))",
        "tuple(fused.split([q_rows, kv_rows, kv_rows]))[::-1]",
        "views returned v, k, q",
    ),
    (QKV, "fuse_rows", "torch.cat(parts)", "torch.cat(parts[::-1])", "parts stacked v, k, q"),
    (
        QKV,
        "book_to_module_state",
        "fuse_rows(q, k, v)",
        "fuse_rows(q, v, k)",
        "book keys and values swapped (fused layout)",
    ),
    (
        QKV,
        "book_to_module_state",
        "fuse_rows(k, v)",
        "fuse_rows(v, k)",
        "book keys and values swapped (q_proj/kv_proj layout)",
    ),
    (
        QKV,
        "book_to_module_state",
        'for kind in ("weight", "bias"):',
        'for kind in ("weight",):',
        "book biases not converted",
    ),
)

# Mutants that change no behaviour, by id (Mutant.id), with the reason. native_decode is
# asked only for a call forward has checked (its docstring): x in the parameters' dtype and
# on their device, a cache forward may write with room for the token.
EQUIVALENT: dict[str, str] = {
    "plan.native_decode: drop `x.dtype != torch.float32`": (
        "forward refuses an x of another dtype than the parameters', and _float32_linear "
        "refuses parameters other than float32: x is float32 whenever weights are returned"
    ),
    "plan.native_decode: drop `not x.is_cpu`": (
        "forward refuses an x on another device than the parameters', and _float32_linear "
        "refuses parameters off the CPU: x is on the CPU whenever weights are returned"
    ),
    "plan._cache_suits: skip-return `if cache.locked_by_inference_mode: return False` -> `pass`": (
        "forward's _check_cache raises for a cache made under inference_mode and written "
        "outside it before the plan is asked; the plan's check is a second guard"
    ),
    "plan._cache_suits: boundary `cache.position < cache.capacity` -> "
    "`cache.position <= cache.capacity`": (
        "position == capacity is reached only by a rolling cache (forward's check_room refuses "
        "a full one first), and `cache.rolling or ...` is then True already"
    ),
    "qkv.book_to_module_state: copy `fuse_rows(k, v)` -> `fuse_rows(v, k)`": (
        "unreachable with any effect: the split layout (q_proj, kv_proj) exists only for "
        "context_dim != d_in, where the book's W_key/W_value (d_out, d_in) never fit kv_proj "
        "(2 kv_dim, context_dim), so load_state_dict raises its size mismatch whatever the order"
    ),
}


@dataclasses.dataclass(frozen=True)
class Mutant:
    path: str  # relative to the repository root
    function: str
    kind: str  # drop, negate, boundary, skip-return, copy
    before: str  # what is replaced, as one line
    after: str
    line: int
    start: int  # byte offsets of the replaced text in the file
    end: int
    replacement: str
    suffix: str = ""  # " #2", " #3": the same id again elsewhere in the function

    @property
    def id(self) -> str:
        """Where and what, stable while the code it names stays (EQUIVALENT's keys)."""
        where = f"{Path(self.path).stem}.{self.function}"
        if self.kind == "drop":  # the operand dropped from its and/or
            return f"{where}: drop `{self.before}`{self.suffix}"
        return f"{where}: {self.kind} `{self.before}` -> `{self.after}`{self.suffix}"

    def apply(self, source: bytes) -> bytes:
        return source[: self.start] + self.replacement.encode() + source[self.end :]


_NEGATED = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}


class _Conditions(ast.NodeVisitor):
    """The condition mutants of one file (module docstring and signatures aside)."""

    def __init__(self, path: str, source: bytes) -> None:
        self.path, self.source = path, source
        self.offsets = [0]
        for line in source.splitlines(keepends=True):
            self.offsets.append(self.offsets[-1] + len(line))
        self.function = "<module>"
        self.mutants: list[Mutant] = []

    def _span(self, node: ast.AST) -> tuple[int, int]:
        start = self.offsets[node.lineno - 1] + node.col_offset
        return start, self.offsets[node.end_lineno - 1] + node.end_col_offset

    def _add(
        self, node: ast.AST, kind: str, new: ast.AST | str, dropped: ast.AST | None = None
    ) -> None:
        if self.function == "<module>":  # conditions of functions only (not TYPE_CHECKING)
            return
        after = new if isinstance(new, str) else ast.unparse(new)
        before = ast.unparse(node if dropped is None else dropped)
        if isinstance(node, ast.Return):  # the if it returns under, for the reader
            before = f"if {ast.unparse(self._if_test)}: {before}"
        replacement = after if isinstance(node, ast.stmt) else f"({after})"
        start, end = self._span(node)
        self.mutants.append(
            Mutant(
                self.path, self.function, kind, before, after, node.lineno, start, end, replacement
            )
        )

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    def visit_If(self, node: ast.If) -> None:
        self.condition(node.test)
        for statement in node.body:
            if isinstance(statement, ast.Return) and _returns_nothing(statement.value):
                self._if_test = node.test
                self._add(statement, "skip-return", "pass")
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self.condition(node.test)
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        if _boolean(node.value):
            self.condition(node.value)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if _boolean(node.value):
            self.condition(node.value)
        self.generic_visit(node)

    def condition(self, node: ast.expr) -> None:
        """Mutants of one condition and of each condition inside it."""
        if isinstance(node, ast.BoolOp):
            for i in range(len(node.values)):
                rest = node.values[:i] + node.values[i + 1 :]
                kept = rest[0] if len(rest) == 1 else ast.BoolOp(op=node.op, values=rest)
                self._add(node, "drop", kept, dropped=node.values[i])
            for operand in node.values:
                self.condition(operand)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self._add(node, "negate", node.operand)
            inner = node.operand
            if isinstance(inner, ast.BoolOp):
                self.condition(inner)
            elif isinstance(inner, ast.Compare) and len(inner.ops) == 1:
                op = type(inner.ops[0])
                if op in _BOUNDARY:
                    self._add(inner, "boundary", _compare(inner, _BOUNDARY[op]))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            op = type(node.ops[0])
            self._add(node, "negate", _compare(node, _NEGATED[op]))
            if op in _BOUNDARY:
                self._add(node, "boundary", _compare(node, _BOUNDARY[op]))
        else:
            self._add(node, "negate", ast.UnaryOp(op=ast.Not(), operand=node))


def _compare(node: ast.Compare, op: type) -> ast.Compare:
    return ast.Compare(left=node.left, ops=[op()], comparators=node.comparators)


def _boolean(node: ast.expr | None) -> bool:
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.Not)
    return isinstance(node, ast.BoolOp | ast.Compare)


def _returns_nothing(value: ast.expr | None) -> bool:
    """return None, return False, return None, None."""
    if value is None:
        return True
    if isinstance(value, ast.Tuple):
        return all(_returns_nothing(v) for v in value.elts)
    return isinstance(value, ast.Constant) and value.value in (None, False)


def condition_mutants(path: str, root: Path) -> list[Mutant]:
    source = (root / path).read_bytes()
    finder = _Conditions(path, source)
    finder.visit(ast.parse(source))
    return finder.mutants


def copy_mutants(root: Path) -> tuple[list[Mutant], list[str]]:
    """COPIES as mutants, and the ids of those whose text is not (once) in its function."""
    mutants, stale = [], []
    for path, function, text, replacement, what in COPIES:
        source = (root / path).read_bytes()
        offsets = [0]
        for line in source.splitlines(keepends=True):
            offsets.append(offsets[-1] + len(line))
        nodes = [
            n
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef) and n.name == function
        ]
        found = []
        for node in nodes:
            begin = offsets[node.lineno - 1]
            body = source[begin : offsets[node.end_lineno - 1] + node.end_col_offset]
            found += [begin + m.start() for m in re.finditer(re.escape(text.encode()), body)]
        name = f"{Path(path).stem}.{function}: copy `{text}` -> `{replacement}` ({what})"
        if len(found) != 1:
            stale.append(f"{name}: found {len(found)} times")
            continue
        start = found[0]
        line = source[:start].count(b"\n") + 1
        mutants.append(
            Mutant(
                path,
                function,
                "copy",
                text,
                replacement,
                line,
                start,
                start + len(text),
                replacement,
            )
        )
    return mutants, stale


def all_mutants(root: Path) -> tuple[list[Mutant], list[str]]:
    """Every mutant, duplicates (the same mutated file) once, each id unique."""
    mutants = condition_mutants(PLAN, root)
    copies, stale = copy_mutants(root)
    unique, seen, ids = [], set(), {}
    for mutant in mutants + copies:
        key = (mutant.path, mutant.apply((root / mutant.path).read_bytes()))
        if key in seen:
            continue
        seen.add(key)
        ids[mutant.id] = ids.get(mutant.id, 0) + 1
        if ids[mutant.id] > 1:
            mutant = dataclasses.replace(mutant, suffix=f" #{ids[mutant.id]}")
        unique.append(mutant)
    return unique, stale


def uncommitted(root: Path, paths: list[str]) -> list[str]:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--", *paths],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def scratch_copy(root: Path, commit: str | None) -> Path:
    """The checkout's tracked and untracked, non-ignored files in a new temporary folder;
    with a `commit`, the tracked ones as committed there (others' edits in progress left
    out)."""
    copy = Path(tempfile.mkdtemp(prefix="attnlab-mutants-"))
    which = ["--others", "--exclude-standard"] + ([] if commit else ["--cached"])
    if commit:
        archive = subprocess.run(
            ["git", "archive", commit], cwd=root, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(copy)], input=archive.stdout, check=True)
    listed = subprocess.run(
        ["git", "ls-files", "-z", *which], cwd=root, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = root / os.fsdecode(name)
        if source.is_file() and not source.is_symlink():
            target = copy / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return copy


@dataclasses.dataclass
class Outcome:
    status: str  # killed, survived, timeout, error
    test: str
    seconds: float


_FAILED = re.compile(r"^(FAILED|ERROR) (.+?)(?: - (.*))?$", re.MULTILINE)  # node, message


def _child_environment(workdir: Path) -> dict[str, str]:
    return {
        "PYTHONPATH": str(workdir / "src"),  # before the editable install's path
        "PYTHONDONTWRITEBYTECODE": "1",
        "CI": "1",  # hypothesis derandomized (tests/conftest.py): the same examples each run
    }


def _pytest_arguments(tests: tuple[str, ...], deselect: tuple[str, ...]) -> list[str]:
    return ["-x", "-q", "-p", "no:cacheprovider", *tests, *(f"--deselect={d}" for d in deselect)]


class Runner:
    """Runs pytest in one working folder. With `fork` (the default), through a server
    process that has imported torch, torch._dynamo, transformers, hypothesis and pytest once
    and forks a child per run (attnlab and the tests are imported afresh in each child, from
    the folder's files): pytest's start costs ~1 s instead of ~7. Otherwise one new
    interpreter per run."""

    def __init__(self, workdir: Path, fork: bool = True) -> None:
        self.workdir = workdir
        self.server = None
        self.child: int | None = None  # the process group of the run in progress
        handle, name = tempfile.mkstemp(prefix="attnlab-mutants-", suffix=".log")
        os.close(handle)
        self.log = Path(name)  # the forked run's output (never inside the checkout)
        if fork:
            self.server = subprocess.Popen(
                [sys.executable, __file__, "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )

    def interrupt(self) -> None:
        """End the run in progress, if any (its process group)."""
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.killpg(self.child, signal.SIGKILL)

    def close(self) -> None:
        self.interrupt()
        if self.server is not None:
            self.server.stdin.close()
            self.server.wait()
        self.log.unlink(missing_ok=True)

    def run(
        self, tests: tuple[str, ...], deselect: tuple[str, ...], timeout: float
    ) -> tuple[Outcome, str]:
        """pytest -x -q over `tests`: survived (all passed), killed (the first failing
        test), timeout, or error (collection, import)."""
        began = time.monotonic()
        if self.server is None:
            code, output = self._interpreter(tests, deselect, timeout)
        else:
            code, output = self._forked(tests, deselect, timeout)
        seconds = time.monotonic() - began
        if code is None:
            return Outcome("timeout", f"(no result in {timeout:.0f} s)", seconds), output
        if code == 0:
            return Outcome("survived", "", seconds), output
        failed = _FAILED.search(output)
        if failed and "::" not in failed.group(2):  # the module itself: its import, its
            what = f"{failed.group(2)} (collecting it: {(failed.group(3) or '')[:80]})"
            return Outcome("killed", what, seconds), output  # parameters' making
        if code == 1 and failed:
            return Outcome("killed", failed.group(2), seconds), output
        tail = output.strip().splitlines()[-1:] or [f"exit {code}"]
        return Outcome("error", (failed.group(2) if failed else tail[0])[:100], seconds), output

    def _interpreter(self, tests, deselect, timeout) -> tuple[int | None, str]:
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", *_pytest_arguments(tests, deselect)],
            cwd=self.workdir,
            env=os.environ | _child_environment(self.workdir),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: a timeout ends its children too
        )
        self.child = process.pid
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            return None, process.communicate()[0]
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
        finally:
            self.child = None
        return process.returncode, output

    def _forked(self, tests, deselect, timeout) -> tuple[int | None, str]:
        log = self.log
        request = {
            "workdir": str(self.workdir),
            "arguments": _pytest_arguments(tests, deselect),
            "log": str(log),
        }
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        self.child = json.loads(self.server.stdout.readline())["pid"]
        try:
            ready, _, _ = select.select([self.server.stdout], [], [], timeout)
            if not ready:
                self.interrupt()
            code = json.loads(self.server.stdout.readline())["code"]
        finally:
            self.child = None
        return (code if ready else None), log.read_text(errors="replace")


def _serve() -> None:
    """The fork server (Runner): preload, then one forked pytest per request line."""
    import hypothesis  # noqa: F401
    import pytest
    import torch
    import torch._dynamo
    import torch.utils.cpp_extension  # noqa: F401

    with contextlib.suppress(ImportError):
        import transformers  # noqa: F401
    assert not any(name.startswith(("attnlab", "tests")) for name in sys.modules)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            code = 3
            try:
                os.setsid()  # its own process group: a timeout ends its children too
                out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(out, 1)
                os.dup2(out, 2)
                os.chdir(request["workdir"])
                environment = _child_environment(Path(request["workdir"]))
                os.environ.update(environment)
                sys.path.insert(0, environment["PYTHONPATH"])
                sys.dont_write_bytecode = True
                code = int(pytest.main(request["arguments"]))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": child}), flush=True)
        _, status = os.waitpid(child, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


class _Restore:
    """The target file's bytes and mtime put back on exit from the block, however it exits
    (SIGTERM raises KeyboardInterrupt in the main thread, as SIGINT does)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.original = path.read_bytes()
        self.mtime = path.stat().st_mtime_ns

    def __enter__(self) -> _Restore:
        return self

    def write(self, mutated: bytes, number: int) -> None:
        self.path.write_bytes(mutated)
        # a time no other version of the file has: no bytecode cached for another one matches
        stamp = self.mtime + (number + 1) * 1_000_000_000
        os.utime(self.path, ns=(stamp, stamp))

    def __exit__(self, *exc) -> None:
        self.path.write_bytes(self.original)
        os.utime(self.path, ns=(self.mtime, self.mtime))


def _raise_on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "-k", dest="only", action="append", help="only mutants whose id contains this (repeatable)"
    )
    parser.add_argument("--list", action="store_true", help="list the mutants, run none")
    parser.add_argument(
        "--head",
        action="store_true",
        help="copy the tracked files as committed at HEAD (untracked ones as they are)",
    )
    parser.add_argument("--in-place", action="store_true", help="mutate the checkout itself")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (copies)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per mutant")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    parser.add_argument(
        "--no-fork", action="store_true", help="a new interpreter per run (no fork server)"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve()
        return 0

    commit = None
    if args.head:  # the mutants' text and offsets: the target files as committed
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        committed = _committed_targets(commit)
        try:
            mutants, stale = all_mutants(committed)
        finally:
            shutil.rmtree(committed, ignore_errors=True)
    else:
        mutants, stale = all_mutants(ROOT)
    if args.only:
        mutants = [m for m in mutants if any(text in m.id for text in args.only)]
        stale = [s for s in stale if any(text in s for text in args.only)]
    if args.list:
        for number, mutant in enumerate(mutants, 1):
            label = " [equivalent]" if mutant.id in EQUIVALENT else ""
            print(f"{number:3d} {mutant.path}:{mutant.line} {mutant.id}{label}")
        for line in stale:
            print(f"STALE {line}")
        print(f"{len(mutants)} mutants, {len(stale)} stale")
        return 0

    paths = sorted({m.path for m in mutants})
    dirty = [] if args.head else uncommitted(ROOT, paths)
    if dirty:
        print("refusing to start: uncommitted changes in a target file:", *dirty, sep="\n  ")
        print("(--head runs on the files as committed)")
        return 2
    signal.signal(signal.SIGTERM, _raise_on_signal)
    jobs = 1 if args.in_place else max(1, args.jobs)
    workdirs = [ROOT] if args.in_place else [scratch_copy(ROOT, commit) for _ in range(jobs)]
    at = f" (the files of {commit[:10]})" if commit else ""
    print(f"{len(mutants)} mutants, {jobs} at a time, in {', '.join(map(str, workdirs))}{at}")
    runners = [Runner(workdir, fork=not args.no_fork) for workdir in workdirs]
    try:
        return _run(runners, mutants, stale, args.timeout)
    except KeyboardInterrupt as stop:  # SIGINT, or SIGTERM (_raise_on_signal)
        print(f"interrupted ({stop or 'SIGINT'}): the runs in progress ended, files restored")
        return 130
    finally:
        for runner in runners:
            runner.close()
            if runner.workdir != ROOT and not args.keep:
                shutil.rmtree(runner.workdir, ignore_errors=True)


def _committed_targets(commit: str) -> Path:
    """A temporary folder holding the target files as committed at `commit`."""
    committed = Path(tempfile.mkdtemp(prefix="attnlab-mutants-head-"))
    for path in TARGETS:
        text = subprocess.run(
            ["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        (committed / path).parent.mkdir(parents=True, exist_ok=True)
        (committed / path).write_bytes(text)
    return committed


def _run(runners: list[Runner], mutants: list[Mutant], stale: list[str], timeout: float) -> int:
    began = time.monotonic()
    for tests, deselect in dict.fromkeys(TARGETS[m.path] for m in mutants):
        outcome, output = runners[0].run(tests, deselect, timeout)  # on the code as it is
        print(f"baseline {' '.join(tests)}: {outcome.status}, {outcome.seconds:.0f} s", flush=True)
        if outcome.status != "survived":
            print(output[-4000:])
            print("these tests fail on the unmutated code: nothing to measure")
            return 2
    results: list = [None] * len(mutants)
    pending = queue.SimpleQueue()
    for number in range(len(mutants)):
        pending.put(number)
    done = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def work(runner: Runner) -> None:
        while not stop.is_set():
            try:
                number = pending.get_nowait()
            except queue.Empty:
                return
            mutant = mutants[number]
            tests, deselect = TARGETS[mutant.path]
            with _Restore(runner.workdir / mutant.path) as restore:
                restore.write(mutant.apply(restore.original), number)
                outcome, _ = runner.run(tests, deselect, timeout)
            status = outcome.status
            if mutant.id in EQUIVALENT:
                status = "equivalent" if status == "survived" else "listed equivalent but killed"
            elif status in ("timeout", "error"):
                status = f"killed ({status})"
            results[number] = (mutant, status, outcome)
            with lock:
                done[0] += 1
                print(
                    f"[{done[0]}/{len(mutants)}] {status:<10} {outcome.seconds:5.1f} s  "
                    f"{mutant.path}:{mutant.line} {mutant.id}  {outcome.test}",
                    flush=True,
                )

    # each runner in a thread; the main thread waits, so that SIGINT or SIGTERM stops the
    # runs in progress and each thread leaves its `with _Restore` (the file restored)
    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in runners]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
    except BaseException:
        stop.set()
        for runner in runners:
            runner.interrupt()
        for thread in threads:
            thread.join(60)
        raise
    finished = [r for r in results if r is not None]
    _table(finished, stale, time.monotonic() - began)
    survivors = [r for r in finished if r[1] in ("survived", "listed equivalent but killed")]
    return 1 if survivors or stale else 0


def _table(results, stale: list[str], seconds: float) -> None:
    print("\n| # | mutant | result | killing test (or why equivalent) |")
    print("|---|---|---|---|")
    for number, (mutant, status, outcome) in enumerate(results, 1):
        detail = EQUIVALENT.get(mutant.id, "") if status == "equivalent" else outcome.test
        text = f"{mutant.path}:{mutant.line} {mutant.id}"
        print(f"| {number} | {_cell(text)} | {status} | {_cell(detail)} |")
    for line in stale:
        print(f"| - | {_cell(line)} | stale | |")
    counts: dict[str, int] = {}
    for _, status, _ in results:
        key = "killed" if status.startswith("killed") else status
        counts[key] = counts.get(key, 0) + 1
    summary = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    print(f"\n{len(results)} mutants: {summary}; {len(stale)} stale; {seconds / 60:.1f} minutes")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


if __name__ == "__main__":
    sys.exit(main())
