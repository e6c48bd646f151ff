"""A calculator tool: evaluates integer arithmetic (+ - * // % and parentheses) without ``eval``.

Input is model output, hence untrusted: length, depth and magnitude are bounded and anything else is a
``ToolError`` whose message becomes the tool result.
"""
from __future__ import annotations

import ast

MAX_EXPRESSION_CHARS = 64
MAX_MAGNITUDE = 10**12


class ToolError(ValueError):
    pass


_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}


def _evaluate(node: ast.AST, depth: int) -> int:
    if depth > 16:
        raise ToolError("expression too deep")
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _evaluate(node.operand, depth + 1)
        value = -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("division by zero")
        value = _BINARY[type(node.op)](left, right)
    else:
        raise ToolError("unsupported expression")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError("number too large")
    return value


def calculate(expression: str) -> int:
    """Value of an integer expression; ``ToolError`` for anything else."""
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError("expression too long")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        raise ToolError("syntax error") from None
    return _evaluate(tree.body, 0)
