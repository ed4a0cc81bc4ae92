"""examples/calculator's task as an ordinary agent program: plain `openai` SDK calls to an OpenAI-compatible endpoint,
with a `calculate` function tool that the program runs itself. Nothing here knows about qgrpo: the program is given a
base URL, an API key and a model name (the `client` argument) and talks to whatever serves them; qgrpo's rollout actors
serve it during a run, and keep each call's exact tokens and log-probs for training.

The task (examples/calculator/env.py): a 3-digit multiplication, scored 1 when the final answer (the number in its last
<answer> tag, else its last number) is the product. Before the question the program shows the same two worked
exchanges as env.py's DEMOS (question, tool call, tool result, tagged answer): without them the untrained
SmolLM2-135M-Instruct never calls the tool. The demos' tool calls are written as the text the model itself would
write (<tool_call>{...}</tool_call>), so that a server whose chat template does not render tools (SmolLM2's) shows
them to the model as env.py's environment does; the model's own calls come back as OpenAI `tool_calls` and are
answered with {"role": "tool", "tool_call_id": ..., "content": ...} messages. At most MAX_TURNS model turns.

    import asyncio, types
    client = types.SimpleNamespace(base_url="http://127.0.0.1:8000/v1", api_key="EMPTY", model="qgrpo-policy")
    asyncio.run(calculator_agent({"question": "Calculate 314 * 365.", "answer": 114610}, client))
"""
from __future__ import annotations

import ast
import json
import operator
import re

import openai

MAX_TURNS = 3  # a call, its result, the answer (and one more call), as examples/calculator/config.toml
TURN_TOKENS = 48  # max_tokens of one model turn (config.toml: turn_tokens)
INSTRUCTION = "Give the final answer inside <answer></answer>."

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
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses (no names, no calls: `ast`, not eval)."""
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    value = _eval(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


# The tool as an OpenAI request's `tools` entry: exactly the schema env.py's ToolEnvironment derives from its
# docstring (transformers' get_json_schema, "return" included), so the server's description of the tools is the same.
CALCULATE = {"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression of numbers, + - * / and parentheses.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string",
                                                 "description": "The expression to evaluate, e.g. \"123 * 456\"."}},
                   "required": ["expression"]},
    "return": {"type": "string"}}}

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*")


def final_number(text: str | None) -> int | None:
    """The number in the last <answer> tag of `text`, else its last number (commas allowed)."""
    text = text or ""
    tagged = _ANSWER.findall(text)
    found = _NUMBER.findall(tagged[-1] if tagged else text)
    return int(found[-1].replace(",", "")) if found else None


# Two worked exchanges (question, call, tool result, final answer), shown before every question, as env.py's DEMOS.
DEMOS = [("213 * 47", "10011"), ("508 * 619", "314452")]


def demo_messages(instruction: str = INSTRUCTION) -> list[dict]:
    out: list[dict] = []
    for k, (expression, product) in enumerate(DEMOS):
        call = json.dumps({"name": "calculate", "arguments": {"expression": expression}})
        out += [{"role": "user", "content": f"Calculate {expression}." + (f"\n{instruction}" if instruction else "")},
                {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                {"role": "tool", "tool_call_id": f"demo-{k}", "content": product},
                {"role": "assistant", "content": f"<answer>{product}</answer>"}]
    return out


def question_of(row: dict) -> tuple[str, str]:
    """(question, instruction) of a row: {"question": ...} as in problems.jsonl, or {"prompt": "question\\n
    instruction"} as qgrpo's task loader writes it (the instruction defaults to INSTRUCTION)."""
    if "question" in row:
        return str(row["question"]), str(row.get("instruction", INSTRUCTION))
    question, _, instruction = str(row["prompt"]).partition("\n")
    return question, instruction or INSTRUCTION


def run_tool(name: str, arguments: str) -> str:
    """A tool call's result, or the error the model should see (a real tool's error message)."""
    if name != "calculate":
        return f"error: there is no tool named {name!r}; the tool is 'calculate'"
    try:
        args = json.loads(arguments or "{}")
        return calculate(str(args["expression"]))
    except Exception as e:  # bad JSON, a missing argument, an expression that is not arithmetic
        return f"error: {type(e).__name__}: {e}"


async def calculator_agent(row: dict, client, *, max_turns: int = MAX_TURNS, max_tokens: int = TURN_TOKENS,
                           temperature: float | None = None) -> float:
    """Solve `row` ({"question" or "prompt", "answer"}) with the model behind `client` (attributes `base_url`,
    `api_key`, `model`) and the `calculate` tool; 1.0 when the final answer is the product, else 0.0.
    `temperature`: None leaves it to the server (a qgrpo run samples at the run's rollout temperature)."""
    question, instruction = question_of(row)
    messages = demo_messages(instruction) + [{"role": "user", "content": f"{question}\n{instruction}"}]
    extra = {} if temperature is None else {"temperature": temperature}
    final: str | None = None
    async with openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as oa:
        for _ in range(max_turns):
            response = await oa.chat.completions.create(model=client.model, messages=messages, tools=[CALCULATE],
                                                        max_tokens=max_tokens, **extra)
            message = response.choices[0].message
            calls = [c for c in message.tool_calls or [] if c.type == "function"]
            turn: dict = {"role": "assistant", "content": message.content}
            if calls:
                turn["tool_calls"] = [{"id": c.id, "type": "function",
                                       "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                      for c in calls]
            messages.append(turn)
            if not calls:
                final = message.content
                break
            for c in calls:
                messages.append({"role": "tool", "tool_call_id": c.id,
                                 "content": run_tool(c.function.name, c.function.arguments)})
    return 1.0 if final_number(final) == int(row["answer"]) else 0.0
