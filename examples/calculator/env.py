"""A calculator tool for 3-digit multiplication: the model may call `calculate` (as
<tool_call>{"name": "calculate", "arguments": {"expression": "123 * 456"}}</tool_call>) and gets the result back in a
tool message; a turn without a call is its final answer, which the environment scores: 1 when the number inside its
last <answer> tag (or else its last number) is the row's answer.

ToolEnvironment (qgrpo.rollout.environments) parses and runs the calls; this file only adds the tool and the score.
"""
from __future__ import annotations

import ast
import operator
import re

from qgrpo.rollout.environments import ToolEnvironment

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

    Args:
        expression: The expression to evaluate, e.g. "123 * 456".
    """
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    value = _eval(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*")


def final_number(text: str) -> int | None:
    """The number in the last <answer> tag of `text`, else its last number (commas allowed)."""
    tagged = _ANSWER.findall(text)
    found = _NUMBER.findall(tagged[-1] if tagged else text)
    return int(found[-1].replace(",", "")) if found else None


class Calculator(ToolEnvironment):
    tools = [calculate]

    def score(self) -> float:
        if self.final is None or self.row is None:
            return 0.0
        return 1.0 if final_number(self.final) == int(self.row["answer"]) else 0.0
