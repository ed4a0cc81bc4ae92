"""rollout/backends/triton_step.py: the fused decode step's Triton kernels (residual + RMSNorm, SwiGLU, rotary + cache
write, attention) against the torch ops they replace, their self-check, and the fused decode that uses them.

Without a GPU they run on CPU tensors in Triton's interpreter, which needs TRITON_INTERPRET=1 before Triton's first
import: ``test_interpreter_tests_pass_in_a_subprocess`` reruns this file's ``*_in_interpreter`` tests in a fresh
Python with it set (they skip in a process without it). There the kernels' products run in float32 (``DOT_F32``) and
float32 -> bf16 casts truncate, so bounds are bf16's (2**-7 relative) plus accumulation order. On a GPU the fused
step's `cuda` tests (tests/test_cuda.py) assert that the kernels passed their self-check there and are in use.
"""

import os

import pytest
import torch

from qgrpo.core.records import SamplingParams
from qgrpo.rollout.backends import torch_fused, torch_graphs, triton_step
from tests.helpers import rerun_in_triton_interpreter
from tests.test_torch_graphs import ITEMS, _eager_graphs, _max_logprob_gap

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def interpreter():
    pytest.importorskip("triton")
    if not INTERPRETING:
        pytest.skip("needs TRITON_INTERPRET=1 before Triton's import: test_interpreter_tests_pass_in_a_subprocess")
    assert triton_step.available(torch.device("cpu"))


@pytest.mark.slow  # `make test-slow` (docs/testing.md)
@pytest.mark.heavy  # 30 s: every interpreter test in a process of its own
def test_interpreter_tests_pass_in_a_subprocess():
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("this process interprets: the interpreter tests run here")
    rerun_in_triton_interpreter(__file__)


def _llama(q_heads: int, kv_heads: int, head_dim: int, layers: int = 1):
    """A random bf16 Llama with these attention shapes (hidden = q_heads x head_dim)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=q_heads * head_dim, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=q_heads, num_key_value_heads=kv_heads, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


# --- Triton's interpreter, CPU tensors ----------------------------------------------------------------------------

@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(4, 4, 16), (4, 2, 32), (12, 2, 16)],
                         ids=["mha", "gqa2", "gqa6"])
def test_self_check_passes_in_interpreter(interpreter, q_heads, kv_heads, head_dim, monkeypatch):
    # Every kernel at these shapes against the torch ops, attention with a row masked mid-block and a block masked
    # whole, queries padded to tl.dot's 16 rows (2 and 6 query heads per key-value head; 12 / 2 is Qwen2.5-1.5B's).
    monkeypatch.setattr(triton_step, "_CHECKED", {})
    assert triton_step.self_check(_llama(q_heads, kv_heads, head_dim), q_heads, kv_heads, head_dim) is None


def test_self_check_catches_a_wrong_kernel_in_interpreter(interpreter, monkeypatch):
    # A kernel that computes something else (here SwiGLU without its gate) is refused, naming it: the step then keeps
    # the torch ops.
    monkeypatch.setattr(triton_step, "_CHECKED", {})
    monkeypatch.setattr(triton_step, "silu_mul", lambda y: y[..., y.shape[-1] // 2:].contiguous())
    why = triton_step.self_check(_llama(4, 2, 32), 4, 2, 32)
    assert why is not None and why.startswith("self-check: silu_mul differs from the torch ops"), why
    monkeypatch.undo()

    def no_compile(*args):
        raise RuntimeError("no compile")

    monkeypatch.setattr(triton_step, "_CHECKED", {})
    monkeypatch.setattr(triton_step, "attend", no_compile)
    assert triton_step.self_check(_llama(4, 2, 32), 4, 2, 32) == "self-check failed: RuntimeError: no compile"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3"])
def test_step_with_the_kernels_equals_the_torch_step_in_interpreter(interpreter, kind, monkeypatch):
    """One fused decode step with the kernels and with torch ops, from the same cache: the same logits (within bf16
    rounding, relative to the largest), the same keys and values written into the step's column and no other; with
    grouped-query attention (4 query heads on 2), Qwen2's projection biases, and a row whose earlier columns are
    masked (left padding); Qwen3's per-head query and key norms and a head_dim of its own."""
    from tests.test_torch_decode import TOL, _model, _off

    model = _model(kind)
    q_heads, kv_heads, hd = 4, 2, getattr(model.config, "head_dim", None) or 16
    on = torch_fused.FusedLayers(model, q_heads, kv_heads, hd)
    monkeypatch.setattr(torch_fused, "KERNELS", False)
    off = torch_fused.FusedLayers(model, q_heads, kv_heads, hd)
    assert on.kernels and not off.kernels
    b, width, col = 3, 20, 12
    g = torch.Generator().manual_seed(4)
    keys = [torch.randn(b, kv_heads, width, hd, generator=g).to(torch.bfloat16) for _ in on.layers]
    values = [torch.randn(b, kv_heads, width, hd, generator=g).to(torch.bfloat16) for _ in on.layers]
    bias = torch.zeros(b, 1, 1, width)
    bias[..., col:] = float("-inf")
    bias[1, ..., :4] = float("-inf")  # left padding
    pos = torch.tensor([col, col - 4, col])
    tokens = torch.tensor([5, 7, 9])
    out = {}
    for name, fused in (("kernels", on), ("torch", off)):
        k, v = [t.clone() for t in keys], [t.clone() for t in values]
        with torch.no_grad():
            logits = torch_fused.step(model, fused, tokens, torch.tensor([col]), pos, k, v, bias.clone(), q_heads,
                                      kv_heads, hd, hd ** -0.5)
        out[name] = logits, k, v
    (lk, kk, vk), (lt, kt, vt) = out["kernels"], out["torch"]
    assert torch.isfinite(lk).all() and _off(lk, lt) < TOL, _off(lk, lt)
    others = torch.arange(width) != col
    for new, ref, old in zip(kk + vk, kt + vt, keys + values):
        assert torch.equal(new[:, :, others], old[:, :, others]) and torch.equal(ref[:, :, others], old[:, :, others])
        assert _off(new[:, :, col].float(), ref[:, :, col].float()) < TOL  # measured: 1.4-1.7% in the second layer
    # the first layer: its values are the same product of the same norm; its keys differ by the rotary's rounding
    # (float32 inside the kernel, one bf16 product in the torch step; measured 0.6%)
    assert torch.equal(vk[0][:, :, col], vt[0][:, :, col])
    assert _off(kk[0][:, :, col].float(), kt[0][:, :, col].float()) < 0.02


def test_fused_decode_with_the_kernels_in_interpreter(interpreter, tiny_model_path, monkeypatch):
    """The fused step with every kernel: rows that stop move the live ones into smaller buckets, each sampled token's
    log-prob is the served model's own full forward's, and greedy output is the static decoder's."""
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    gen = _eager_graphs(tiny_model_path)
    assert gen.graphs.fused.kernels and gen.decode_info()["kernels"] == "triton"
    monkeypatch.setattr(torch_graphs, "CHECK_EVERY", 2)
    buckets = []
    compact = gen.graphs._compact
    monkeypatch.setattr(gen.graphs, "_compact", lambda b, nb: buckets.append(nb) or compact(b, nb))
    groups = gen.generate(ITEMS[:2], SamplingParams(group_size=8, max_new_tokens=8, temperature=1.0, seed=7))
    assert _max_logprob_gap(gen, groups) < 0.05
    assert buckets == sorted(buckets, reverse=True)
    sp = SamplingParams(group_size=2, max_new_tokens=12, temperature=0.0)
    want = TorchGenerator(tiny_model_path).generate(ITEMS, sp)
    got = gen.generate(ITEMS, sp)
    for a, b in zip(want, got):
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]


def test_kernels_off_leave_the_torch_ops_in_interpreter(interpreter, tiny_model_path, monkeypatch):
    monkeypatch.setattr(torch_fused, "KERNELS", False)
    gen = _eager_graphs(tiny_model_path)
    assert not gen.graphs.fused.kernels and gen.decode_info()["kernels"] == "off (torch_fused.KERNELS)"


# --- any process ----------------------------------------------------------------------------------------------------

def test_on_a_cpu_without_the_interpreter_the_step_keeps_torch_ops(tiny_model_path):
    if INTERPRETING:
        pytest.skip("this process interprets: the kernels run on CPU tensors")
    gen = _eager_graphs(tiny_model_path)
    assert not gen.graphs.fused.kernels and gen.decode_info()["kernels"] == "no Triton for cpu tensors"
