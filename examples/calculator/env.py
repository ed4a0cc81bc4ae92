"""A calculator tool for 3-digit multiplication: the model may call `calculate` (as
<tool_call>{"name": "calculate", "arguments": {"expression": "123 * 456"}}</tool_call>) and gets the result back in a
tool message; a turn without a call is its final answer, which the environment scores: 1 when the number inside its
last <answer> tag (or else its last number) is the row's answer.

ToolEnvironment (qgrpo.rollout.environments) parses and runs the calls; this file adds the tool, the score and two
worked exchanges before each question (`DEMOS`): told the call format alone (the system message), the untrained
SmolLM2-135M-Instruct wrote a call in none of 64 samples at temperature 1; after a single worked exchange it copied
the final answer's tags and not the call (1 of 64); after two it called the tool in 25 of 64 (22 well-formed), so
GRPO has calls to reinforce. The task is unchanged: 3-digit multiplication, scored on the exact product.
"""
from __future__ import annotations

import ast
import json
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


def _call(expression: str) -> str:
    return json.dumps({"name": "calculate", "arguments": {"expression": expression}})


# Two worked exchanges (question, call, tool result, final answer), shown before every question.
DEMOS = [("213 * 47", "10011"), ("508 * 619", "314452")]


def demo_messages(instruction: str) -> list[dict]:
    """The worked exchanges as chat turns; each question gets the task's `instruction` as every real one does."""
    out: list[dict] = []
    for expression, product in DEMOS:
        out += [{"role": "user", "content": f"Calculate {expression}." + (f"\n{instruction}" if instruction else "")},
                {"role": "assistant", "content": f"<tool_call>{_call(expression)}</tool_call>"},
                {"role": "tool", "content": product},
                {"role": "assistant", "content": f"<answer>{product}</answer>"}]
    return out


class Calculator(ToolEnvironment):
    tools = [calculate]

    def reset(self, row: dict) -> list[dict]:
        """The worked exchanges, then the row's question (its prompt: the question, a newline, task.instruction)."""
        first = super().reset(row)
        return demo_messages(str(row["prompt"]).partition("\n")[2]) + first

    def score(self) -> float:
        if self.final is None or self.row is None:
            return 0.0
        return 1.0 if final_number(self.final) == int(self.row["answer"]) else 0.0
