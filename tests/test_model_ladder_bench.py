"""bench/model_ladder.py and bench/model_shapes.py on a CPU: the published shapes build to the published parameter
counts, the ladder's dry run measures every variant at tiny shapes with finite bounds, and a spent budget skips."""
import json
import statistics

import pytest

from bench import model_ladder
from bench.model_shapes import SHAPES, build_config, parameter_count
from qgrpo.rollout.backends import onednn
from qgrpo.rollout.quantization import cpu_native

# The parameter counts the models' cards and safetensors indexes publish (norms and biases included).
PUBLISHED = {"SmolLM2-135M": 134_515_008, "Qwen2.5-0.5B": 494_032_768, "Llama-3.2-1B": 1_235_814_400,
             "Qwen2.5-1.5B": 1_543_714_304, "Qwen3-4B": 4_022_468_096, "Qwen3-8B": 8_190_735_360,
             "Qwen2.5-14B": 14_770_033_664}


def _reject(name: str):
    raise AssertionError(f"{name} in the JSON")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_published_shape_builds_to_its_published_size(name):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # no memory: shapes only
        model = AutoModelForCausalLM.from_config(build_config(name))
    assert model.config.model_type == SHAPES[name][0]
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    products = parameter_count(name)["total"]
    assert 0.999 * PUBLISHED[name] < products <= PUBLISHED[name]  # norms and biases are the rest


@pytest.mark.heavy  # ~15 s: eight tiny variants measured
def test_dry_run_measures_every_variant_with_finite_bounds(tmp_path):
    out = tmp_path / "ladder.json"
    res = model_ladder.main(["--device", "cpu", "--models", "tiny-qwen2,tiny-qwen3", "--precisions", "bf16,int8",
                             "--rows", "1,8", "--contexts", "24", "--new-tokens", "4", "--repeats", "1",
                             "--out", str(out)])
    saved = json.loads(out.read_text(), parse_constant=_reject)  # no NaN / Infinity anywhere
    assert saved["rows"] == json.loads(json.dumps(res["rows"]))
    assert res["budget"]["skipped"] == [] and res["machine"].endswith(f"transformers {res['transformers']}")
    rows = {(r["model"], r["precision"], r["rows"]): r for r in res["rows"]}
    assert set(rows) == {(m, p, n) for m in ("tiny-qwen2", "tiny-qwen3") for p in ("bf16", "int8") for n in (1, 8)}
    for key, r in rows.items():
        assert "error" not in r and "skipped" not in r, (key, r)
        assert r["full"] and r["context"] == 24, key
        assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0, key
        # Decode timed by the generator's own clock, which starts after the prompts' forward and ends before the call
        # returns: within each timed call, and the figure is the tokens over its median.
        assert r["decode_timing"] == "generator", key
        assert all(0 < x["decode_s"] < x["seconds"] for x in r["runs"]), key
        median = statistics.median(x["decode_s"] for x in r["runs"])
        assert r["decode_tokens_per_s"] == pytest.approx(key[2] * 4 / median), key
        assert r["mem_bound_tokens_per_s"] > 0 and r["compute_bound_tokens_per_s"] > 0, key
        assert r["binds"] in ("memory", "compute") and 0 < r["share_of_bound"], key
        # Every architecture of the ladder decodes on the generator's static decoder, not transformers' forward.
        assert r["decode_loop"] == "static", key
        if key[1] == "int8":
            base = rows[(key[0], "bf16", key[2])]
            assert r["linear_bytes"] < 0.7 * base["linear_bytes"]
            assert r["vs_bf16"] == pytest.approx(r["decode_tokens_per_s"] / base["decode_tokens_per_s"])
    assert "| tiny-qwen3 | int8 |" in res["table"]


def test_prompts_have_exactly_the_asked_length():
    from transformers import AutoTokenizer

    from qgrpo.rollout.modeling.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-digits"))
    for n in (5, 64):
        items = model_ladder.prompts_of(tok, 3, n)
        assert len({it.prompt for it in items}) == 3  # distinct prompts: a realistic prefill
        assert all(len(tok(it.prompt)["input_ids"]) == n for it in items)


def test_a_spent_budget_skips_every_variant_and_says_so(tmp_path):
    res = model_ladder.main(["--device", "cpu", "--models", "tiny-llama", "--precisions", "bf16,int8", "--rows", "8",
                             "--contexts", "16", "--budget-s", "0", "--out", str(tmp_path / "l.json")])
    assert res["budget"]["skipped"] == ["tiny-llama/bf16", "tiny-llama/int8"]
    assert all(r.get("skipped") == "budget spent" for r in res["rows"])


def test_unknown_model_or_precision_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        model_ladder.main(["--device", "cpu", "--models", "Qwen9-1T"])
    assert "--models: unknown Qwen9-1T" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        model_ladder.main(["--device", "cpu", "--models", "tiny-llama", "--precisions", "fp8"])
    assert "--precisions: fp8 not served" in capsys.readouterr().err


def test_a_tied_head_quantized_is_its_own_variant(tmp_path):
    res = model_ladder.main(["--device", "cpu", "--models", "tiny-qwen2", "--precisions", "bf16,int8,int8+head",
                             "--rows", "1", "--contexts", "16", "--new-tokens", "2", "--repeats", "1",
                             "--out", str(tmp_path / "ladder.json")])
    rows = {r["precision"]: r for r in res["rows"]}
    assert all("error" not in r and r["decode_tokens_per_s"] > 0 for r in rows.values()), rows
    # tiny-qwen2 ties its head: int8 keeps it in the compute dtype (512 x 64 x 2 bytes in bf16, x 4 in fp32 on a CPU
    # without native bf16), int8+head holds it in int8, one byte a weight and a scale per row
    element = {"bf16": 2, "fp32": 4}[rows["int8"]["compute"]]
    saved = rows["int8"]["linear_bytes"] - rows["int8+head"]["linear_bytes"]
    assert 512 * 64 * (element - 1) - 512 * 8 <= saved <= 512 * 64 * (element - 1)
    if element == 4 and onednn.available():  # int8's tied fp32 head is a oneDNN copy beside the embedding: its bytes
        assert rows["int8"]["total_bytes"] - rows["int8+head"]["total_bytes"] == saved
    else:  # int8's head is the embedding itself; int8+head's quantized copy sits beside it
        assert rows["int8+head"]["total_bytes"] > rows["int8"]["total_bytes"]
    assert "vs_bf16" in rows["int8+head"]


def test_bf16_through_f_linear_is_its_own_variant(tmp_path):
    res = model_ladder.main(["--device", "cpu", "--models", "tiny-qwen2", "--precisions", "bf16,bf16/torch",
                             "--rows", "1", "--contexts", "16", "--new-tokens", "2", "--repeats", "1",
                             "--out", str(tmp_path / "ladder.json")])
    rows = {r["precision"]: r for r in res["rows"]}
    assert all("error" not in r and r["decode_tokens_per_s"] > 0 for r in rows.values()), rows
    assert rows["bf16"]["linear_bytes"] == rows["bf16/torch"]["linear_bytes"]
    # on a float32 CPU, bf16 packs its tied head for oneDNN as a copy (512 x 64 fp32); bf16/torch does not
    packed = rows["bf16"]["compute"] == "fp32" and onednn.available()
    assert rows["bf16"]["total_bytes"] - rows["bf16/torch"]["total_bytes"] == (512 * 64 * 4 if packed else 0)
    assert "vs_bf16" in rows["bf16/torch"]


def test_the_former_int4_route_is_its_own_variant_and_the_rule_comes_back(tmp_path, monkeypatch):
    from qgrpo.rollout.quantization import cpu_kernels

    seen = []
    real = cpu_kernels.int4_kernel
    monkeypatch.setattr(cpu_kernels, "int4_kernel", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    rule = cpu_kernels.cpu_int4_rows
    res = model_ladder.main(["--device", "cpu", "--models", "tiny-llama", "--precisions", "int4/kernel",
                             "--rows", "1", "--contexts", "600", "--new-tokens", "2", "--repeats", "1",
                             "--out", str(tmp_path / "ladder.json")])
    assert all("error" not in r and r["prefill_tokens_per_s"] > 0 for r in res["rows"]), res["rows"]
    assert 600 in seen  # the 600-token prompt's forward went through the kernel, past any measured rows
    assert cpu_kernels.cpu_int4_rows is rule


def test_int8_torch_variant_takes_torch_kernel_and_int8_takes_ours(tmp_path, monkeypatch):
    """`int8/torch` sends the int8 products through torch's `_weight_int8pack_mm` (qgrpo's kernel switched off for the
    variant and back on after), `int8` through qgrpo's where it is built here."""
    import torch

    from qgrpo.rollout.quantization import cpu_kernels, cpu_native

    # Every product of up to 64 rows takes a kernel: which kernel is the variant's, whatever this CPU's measured
    # crossover says (on an AVX2-only CPU torch's kernel, bf16 emulated, may lose to the cast route at every row).
    monkeypatch.setattr(cpu_kernels, "cpu_int8_rows", lambda n, k, dtype: cpu_kernels.INT8_KERNEL_MAX_ROWS)
    calls = {"torch": 0, "ours": 0}
    real_torch, real_ours = torch._weight_int8pack_mm, cpu_native.w8a16_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm",
                        lambda *a: calls.__setitem__("torch", calls["torch"] + 1) or real_torch(*a))
    monkeypatch.setattr(cpu_native, "w8a16_mm",
                        lambda *a: calls.__setitem__("ours", calls["ours"] + 1) or real_ours(*a))
    args = ["--device", "cpu", "--models", "tiny-qwen2", "--rows", "1", "--contexts", "32", "--new-tokens", "2",
            "--repeats", "1"]
    res = model_ladder.main([*args, "--precisions", "int8/torch", "--out", str(tmp_path / "a.json")])
    assert all("error" not in r for r in res["rows"]) and calls["torch"] > 0 and calls["ours"] == 0
    assert res["cpu_int8_kernel"] == cpu_native.describe()
    if cpu_native.available():
        calls.update(torch=0, ours=0)
        model_ladder.main([*args, "--precisions", "int8", "--out", str(tmp_path / "b.json")])
        assert calls["ours"] > 0 and calls["torch"] == 0


@pytest.mark.skipif(not cpu_native.available(), reason="qgrpo's int8 kernel is not built here")
def test_int8_noprefetch_variant_runs_the_kernel_without_its_prefetch(tmp_path, monkeypatch):
    """`int8/noprefetch` sends the int8 products through qgrpo's kernel with INT8_PREFETCH at 0, `int8` with the
    kernel's own distance; the switch is put back after the variant."""
    from qgrpo.rollout.quantization import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "cpu_int8_rows", lambda n, k, dtype: cpu_kernels.INT8_KERNEL_MAX_ROWS)
    seen = []
    real = cpu_native.w8a16_mm
    monkeypatch.setattr(cpu_native, "w8a16_mm", lambda *a: seen.append(cpu_native.INT8_PREFETCH) or real(*a))
    held = cpu_native.INT8_PREFETCH
    assert held > 0
    args = ["--device", "cpu", "--models", "tiny-qwen2", "--rows", "1", "--contexts", "32", "--new-tokens", "2",
            "--repeats", "1", "--interleave", "--precisions", "int8/noprefetch,int8"]
    res = model_ladder.main([*args, "--out", str(tmp_path / "a.json")])
    assert all("error" not in r for r in res["rows"]) and {r["precision"] for r in res["rows"]} == {
        "int8/noprefetch", "int8"}
    assert set(seen) == {0, held} and cpu_native.INT8_PREFETCH == held


def test_int8_fused_variant_decodes_through_the_fused_step_eagerly(tmp_path):
    """`int8/fused` decodes a CPU generator through torch_fused's step run eagerly (its q/k/v and gate/up joined),
    `int8` through the static decoder's; both every token of every row."""
    args = ["--device", "cpu", "--models", "tiny-qwen2", "--rows", "1,8", "--contexts", "24", "--new-tokens", "4",
            "--repeats", "1", "--precisions", "int8,int8/fused"]
    res = model_ladder.main([*args, "--out", str(tmp_path / "a.json")])
    rows = {(r["precision"], r["rows"]): r for r in res["rows"]}
    assert set(rows) == {(p, n) for p in ("int8", "int8/fused") for n in (1, 8)}
    for (precision, _), r in rows.items():
        assert "error" not in r and r["full"] and r["decode_loop"] == "static"
        assert r["decode_fused"] is (precision == "int8/fused")


def test_int4_torch_variant_keeps_qgrpo_kernel_out_and_int4_takes_it(tmp_path, monkeypatch):
    """`int4/torch` keeps qgrpo's int4 kernel out (torch's `_weight_int4pack_mm_for_cpu` takes the decode step's
    products), `int4` sends them through qgrpo's where it is built here; the JSON names both int4 kernels' source."""
    from qgrpo.rollout.quantization import cpu_kernels, cpu_native

    calls = {"ours": 0}
    real = cpu_native.w4a16_mm
    monkeypatch.setattr(cpu_native, "w4a16_mm", lambda *a: calls.__setitem__("ours", calls["ours"] + 1) or real(*a))
    args = ["--device", "cpu", "--models", "tiny-qwen2", "--rows", "1", "--contexts", "32", "--new-tokens", "2",
            "--repeats", "1"]
    res = model_ladder.main([*args, "--precisions", "int4/torch", "--out", str(tmp_path / "a.json")])
    assert all("error" not in r for r in res["rows"]) and calls["ours"] == 0
    assert res["cpu_int4_kernel"] == cpu_kernels.describe("int4")
    if cpu_native.available():
        res = model_ladder.main([*args, "--precisions", "int4", "--out", str(tmp_path / "b.json")])
        assert all("error" not in r for r in res["rows"]) and calls["ours"] > 0


@pytest.mark.heavy  # ~10 s: three tiny generators held at once
def test_interleave_times_every_variant_in_turn_rotating_the_order(tmp_path, monkeypatch):
    """`--interleave` builds each precision's generator once, then per (context, rows) warms each and times one
    generate of each per repeat, repeat r starting at the r-th variant; a variant that fails to build records its
    error and the others are measured."""
    entered = []
    real = model_ladder.switches
    monkeypatch.setattr(model_ladder, "switches", lambda p: entered.append(p) or real(p))
    real_open = model_ladder.open_variant

    def open_variant(args, name, precision, *rest):
        if precision == "nf4":
            raise RuntimeError("no nf4 today")
        return real_open(args, name, precision, *rest)

    monkeypatch.setattr(model_ladder, "open_variant", open_variant)
    res = model_ladder.main(["--device", "cpu", "--models", "tiny-qwen2", "--precisions", "bf16,int8,nf4,int4",
                             "--rows", "1,8", "--contexts", "24", "--new-tokens", "3", "--repeats", "3",
                             "--interleave", "--out", str(tmp_path / "ladder.json")])
    variants = ["bf16", "int8", "int4"]
    assert entered[:3] == variants  # built in turn (nf4 failed before its switches)
    per_cell = variants + variants + variants[1:] + variants[:1] + variants[2:] + variants[:2]
    assert entered[3:] == per_cell * 2  # warm-ups, then repeats 0, 1, 2 rotated; two cells (rows 1 and 8)
    rows = {(r["precision"], r["rows"]): r for r in res["rows"]}
    assert "no nf4 today" in rows[("nf4", None)]["error"]
    for p in variants:
        for n in (1, 8):
            r = rows[(p, n)]
            assert "error" not in r and r["full"] and len(r["runs"]) == 3, (p, n, r)
            assert r["decode_tokens_per_s"] > 0 and r["share_of_bound"] > 0
            if p != "bf16":
                base = rows[("bf16", n)]["decode_tokens_per_s"]
                assert r["vs_bf16"] == pytest.approx(r["decode_tokens_per_s"] / base)
    assert res["args"]["interleave"] is True


def test_bounds_take_the_best_read_of_the_machine_and_rebound_reads_it_again(tmp_path, monkeypatch):
    out = tmp_path / "l.json"
    res = model_ladder.main(["--device", "cpu", "--models", "tiny-llama", "--precisions", "bf16", "--rows", "2",
                             "--contexts", "16", "--new-tokens", "2", "--repeats", "1", "--out", str(out)])
    reads = res["rate_reads"]
    assert len(reads) == 2  # at the start and at the end of the run
    best = max(r["bandwidth"]["bytes_per_s"] for r in reads)
    assert res["bandwidth"]["bytes_per_s"] == best
    assert res["matmul"]["tiny-llama"] == max(r["matmul"]["tiny-llama"] for r in reads)
    row = next(r for r in res["rows"] if r.get("decode_tokens_per_s"))
    assert row["mem_bound_tokens_per_s"] == pytest.approx(2 * best / row["step_bytes"])

    # A later read ten times faster is the machine's best: the bounds move with it and the command records the read.
    faster = {"bandwidth": {"bytes_per_s": 10 * best}, "matmul": {"tiny-llama": 10 * res["matmul"]["tiny-llama"]},
              "matmul_routes": {"tiny-llama": {}}}
    monkeypatch.setattr(model_ladder, "machine_rates", lambda args, dtype: faster)
    again = model_ladder.main(["--rebound", str(out)])
    saved = json.loads(out.read_text(), parse_constant=_reject)
    assert saved["rows"] == json.loads(json.dumps(again["rows"])) and len(saved["rate_reads"]) == 3
    moved = next(r for r in saved["rows"] if r.get("decode_tokens_per_s"))
    assert moved["mem_bound_tokens_per_s"] == pytest.approx(10 * row["mem_bound_tokens_per_s"])
    assert moved["share_of_bound"] < row["share_of_bound"]
    assert saved["command"].splitlines()[1].endswith(f"bench/model_ladder.py --rebound {out}")

    # Another machine's run is refused, naming both, and the file is left as it was.
    saved["machine"] = "a CPU elsewhere"
    out.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="measured on 'a CPU elsewhere'"):
        model_ladder.main(["--rebound", str(out)])
    assert json.loads(out.read_text()) == saved
