"""The torch generator's decode loop replayed as CUDA graphs (`[rollout.torch] cuda_graphs`).

A decode step of the static decoder (torch_decode.py) is over a thousand small kernels; on a GPU their launches and
the host's Python, not the weights' bytes, bound the loop (a 1.3B model on an H200: ~26 ms a step where the weights
take ~0.7 ms to read). A CUDA graph records a step's kernels once and replays them with one launch; the step it
records is torch_fused.py's (`fused=True`, `[rollout.torch] fused_step`, the default: 330 kernels a step at 8 rows
on an H200, 2.0-2.2x faster) or the static decoder's (`fused=False`, 1,373 kernels). A graph replays fixed
shapes at fixed addresses, so everything a step reads or writes lives in buffers allocated once:

- **Buckets.** The step is captured per batch bucket: the rows rounded up to a power of two (`BUCKETS`, from 8). When
  finished rows leave the live ones within a smaller bucket, the live rows are moved to the front of the buffers
  (compaction) and the smaller bucket's graph replays. Rows of a bucket beyond the live ones ride along with their
  output sent to a spare row of the output buffers.
- **Sampling inside the graph.** The call's uniforms are drawn up front from its seeded generator, one per (step,
  output row) ([L, rows]), and each step picks its row's uniform by index: the graph holds no random state, a seeded
  call is reproducible, and a row's draw does not depend on which bucket it decoded in.
- **No host synchronisation per token.** The step writes its token and log-prob into the output buffers, marks rows
  that sampled a stop token, feeds padding to finished rows, and advances the column, positions and step counter on
  the device. The host looks at the finished rows every `CHECK_EVERY` steps (one synchronisation) to stop early or
  move to a smaller bucket.
- **Weights at fixed addresses.** A sync re-quantizes into the storage the graph reads (rollout/quantization/quant.py:
  requantize_in_place); adapters wrap modules anew. Before a call the decoder compares the addresses of every weight
  tensor (and the modules holding them) with those it captured, and captures again when they differ, so a graph can
  never keep sampling an old policy (tests/test_cuda.py).

The buffers (KV cache of `rows x width` per layer, mask, positions) are kept between calls and grown when a call needs
more rows, columns or steps; the graphs are kept with them. Capture runs the step once eagerly (warm-up), then records
it; its seconds are `capture_seconds`. If capture fails (a kernel that cannot be captured), the same step runs eagerly
for good and `fallback` says why: the loop is the same, one Python step per token.
Off CUDA the loop runs its step eagerly (`graphs=False`); that is how its logic is tested on CPU.
"""
from __future__ import annotations

import time

import torch

from qgrpo.rollout.backends import torch_fused
from qgrpo.rollout.backends.torch_decode import StaticDecoder, _fixed_step, pick

BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024)
CHECK_EVERY = 8  # decode steps between two looks at the finished rows (one host synchronisation each)
WIDTH_ROUND = 128  # cache columns are allocated in multiples of this, so calls of nearby lengths share graphs


def bucket_for(rows: int) -> int:
    """The smallest bucket holding `rows` rows (a multiple of the largest bucket beyond it)."""
    for b in BUCKETS:
        if rows <= b:
            return b
    return -(-rows // BUCKETS[-1]) * BUCKETS[-1]


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


class GraphDecoder:
    """Decodes a prefilled batch with fixed-shape steps (see the module docstring); `graphs` replays them as CUDA
    graphs, else runs them eagerly."""

    def __init__(self, model, pad_id: int, stop_ids: list[int], graphs: bool = True, fused: bool = True):
        self.model = model
        self.static = StaticDecoder(model)  # its model geometry (heads, head_dim, scale, window)
        self.pad_id = pad_id
        self.stop_ids = list(stop_ids)
        self.graphs = graphs
        self.fallback: str | None = None if graphs else "graphs off"
        self.capture_seconds = 0.0
        self.captures = 0  # graphs captured so far (a weight change or a larger buffer captures again)
        self._cap = (0, 0, 0)  # rows, width, steps the buffers hold
        self._graphs: dict = {}
        s = self.static
        self.fuse = fused
        # torch_fused's view of the layers (it joins projections into one buffer now), or None: the static step
        self.fused = torch_fused.FusedLayers(model, s.q_heads, s.kv_heads, s.head_dim) if fused else None
        self._fingerprint = None

    # ---------------------------------------------------------------- buffers
    def _alloc(self, rows: int, width: int, steps: int, dtype: torch.dtype, device: torch.device) -> None:
        s = self.static
        if rows <= self._cap[0] and width <= self._cap[1] and steps <= self._cap[2]:
            return
        rows, width, steps = max(rows, self._cap[0]), max(width, self._cap[1]), max(steps, self._cap[2])
        self._graphs.clear()  # graphs read the old buffers' addresses
        self.keys = self.values = None
        z = dict(device=device)
        shape = (rows, s.kv_heads, width, s.head_dim)
        # Zeros, not empty: attention reads every column, and unwritten memory may hold NaN bit patterns.
        self.keys = [torch.zeros(shape, dtype=dtype, **z) for _ in s.layers]
        self.values = [torch.zeros(shape, dtype=dtype, **z) for _ in s.layers]
        self.bias = torch.zeros((rows, 1, 1, width), dtype=torch.float32, **z)
        self.pos = torch.zeros(rows, dtype=torch.long, **z)
        self.tok = torch.full((rows,), self.pad_id, dtype=torch.long, **z)
        self.live = torch.zeros(rows, dtype=torch.bool, **z)
        self.rowmap = torch.full((rows,), rows, dtype=torch.long, **z)  # output row of each decoder row; `rows` = spare
        self.col = torch.zeros(1, dtype=torch.long, **z)
        self.stepi = torch.zeros(1, dtype=torch.long, **z)
        self.u = torch.zeros((steps, rows + 1), dtype=torch.float32, **z)
        self.out_tok = torch.full((rows + 1, steps), self.pad_id, dtype=torch.long, **z)
        self.out_lp = torch.zeros((rows + 1, steps), dtype=torch.float32, **z)
        self.stop = torch.tensor(self.stop_ids or [-1], dtype=torch.long, **z)  # -1: no token stops
        self._cap = (rows, width, steps)

    def _weights_fingerprint(self) -> tuple:
        """The addresses of every tensor the step reads from the model, with the modules holding them: a sync that
        re-allocated a weight, or adapters wrapped around a layer, change it."""
        from qgrpo.rollout.quantization.quant import _storage_tensors

        out = []
        for m in self.model.modules():
            for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
                out.append((id(m), tuple(x.data_ptr() for x in _storage_tensors(t))))
            for name in ("_int8", "_fp8"):  # tensors a quantized forward holds outside its parameters
                for x in getattr(m, "__dict__", {}).get(name, ()) or ():
                    if isinstance(x, torch.Tensor):
                        out.append((id(m), x.data_ptr()))
        return tuple(out)

    def _prepare(self) -> None:
        """The step's view of the layers, made again after modules or weights moved (a first call, adapters wrapped
        around layers, a layer replaced at a sync): fused projections where they can be (torch_fused.fuse)."""
        s = self.static
        if self.fuse:
            self.fused = torch_fused.FusedLayers(self.model, s.q_heads, s.kv_heads, s.head_dim)

    def _refresh(self) -> None:
        """Where any weight the step reads moved since the step's view was made: the view made again (eager steps
        read the projections as they are now too) and the graphs dropped, to be captured again."""
        fp = self._weights_fingerprint()
        if fp != self._fingerprint:
            self._graphs.clear()
            self._prepare()
            self._fingerprint = self._weights_fingerprint()

    # ---------------------------------------------------------------- the step
    def _step(self, b: int, sp) -> None:
        """One decode step of the first `b` buffer rows, all on the device (what a graph records)."""
        s = self.static
        keys, values = [k[:b] for k in self.keys], [v[:b] for v in self.values]
        tok_in, live, rows = self.tok[:b], self.live[:b], self.rowmap[:b]
        if self.fused is not None:
            logits = torch_fused.step(self.model, self.fused, tok_in, self.col, self.pos[:b], keys, values,
                                      self.bias[:b], s.q_heads, s.kv_heads, s.head_dim, s.scale)
        else:
            logits = _fixed_step(self.model, s.layers, tok_in, self.col, self.pos[:b], keys, values, self.bias[:b],
                                 s.q_heads, s.kv_heads, s.head_dim, s.scale)
        u = None if sp.temperature <= 0 else self.u.index_select(0, self.stepi).squeeze(0).index_select(0, rows)
        tok, lp = pick(logits, sp, u)
        at = self.stepi.expand(b)
        self.out_tok.index_put_((rows, at), torch.where(live, tok, self.pad_id))
        self.out_lp.index_put_((rows, at), torch.where(live, lp, 0.0))
        tok_in.copy_(torch.where(live, tok, self.pad_id))  # finished rows are fed padding; their output is unread
        live.logical_and_((tok[:, None] != self.stop[None, :]).all(-1))
        self.col.add_(1)
        self.pos[:b].add_(1)
        self.stepi.add_(1)

    def _run_step(self, b: int, sp) -> None:
        key = (b, float(sp.temperature), int(sp.top_k), float(sp.top_p))
        graph = self._graphs.get(key) if self.fallback is None else None
        if graph is None and self.fallback is None:
            graph = self._capture(b, sp, key)
        if graph is not None:
            graph.replay()
        else:
            self._step(b, sp)

    def _capture(self, b: int, sp, key):
        """Capture the step of bucket `b` (its state saved and restored around the warm-up), or None and the reason
        in `fallback` when it cannot be."""
        t0 = time.perf_counter()
        saved = [t.clone() for t in (self.col, self.stepi, self.pos, self.tok, self.live, self.bias)]
        try:
            side = torch.cuda.Stream(self.col.device)
            side.wait_stream(torch.cuda.current_stream(self.col.device))
            with torch.cuda.stream(side):
                self._step(b, sp)  # warm-up: lazy initialisations (cuBLAS workspaces, first uses) out of the graph
            torch.cuda.current_stream(self.col.device).wait_stream(side)
            self._restore(saved)
            graph = torch.cuda.CUDAGraph()
            pool = next(iter(self._graphs.values())).pool() if self._graphs else None
            # thread_local: another thread of the actor touching CUDA meanwhile does not break the capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._step(b, sp)
            torch.cuda.synchronize(self.col.device)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot be captured: the same step runs eagerly
            self.fallback = f"capture failed: {type(e).__name__}: {e}"[:500]
            torch.cuda.synchronize(self.col.device)
            graph = None
        self._restore(saved)  # capture records without running; a failed one may have run part of the step
        self._graphs[key] = graph
        self.captures += graph is not None
        self.capture_seconds += time.perf_counter() - t0
        return graph

    def _restore(self, saved) -> None:
        for dst, src in zip((self.col, self.stepi, self.pos, self.tok, self.live, self.bias), saved):
            dst.copy_(src)

    # ---------------------------------------------------------------- a call
    @torch.inference_mode()
    def run(self, cache, attn: torch.Tensor, logits: torch.Tensor, group: int, max_new: int, sp,
            rng: torch.Generator, stop_ids: list[int] | None = None,
            boundary=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode after a prefill: `cache` (transformers' cache of N prompts, left-padded to P columns, `attn` [N, P]
        their mask), `logits` [N*group, V] float32 of each row's first token; -> sampled tokens and log-probs
        [N*group, <= max_new] on the CPU, rows padded after their stop token (log-prob 0), as the eager loop returns.
        `stop_ids`: the generator's stop tokens, where they changed since the decoder was made. `boundary(column)`:
        called before each output column `column` is decoded, as the eager loop calls it (a completion of a few
        tokens can take a load in flight too), to apply a weight update that arrived during the call
        (TorchGenerator._boundary; a Python call where no load waits); True if the weights changed, and if their
        addresses moved with them (adapters, a replaced layer) the step's view is made again and its graphs captured
        again."""
        n, p = attn.shape
        B, L, dev = n * group, max_new, attn.device
        first = cache.layers[0].keys
        if stop_ids is not None and list(stop_ids) != self.stop_ids:
            self.stop_ids = list(stop_ids)
            self._cap = (0, 0, 0)  # the graphs read the stop tokens' tensor: new buffers, new graphs
        self._alloc(bucket_for(B), _round_up(p + L, WIDTH_ROUND), L, first.dtype, dev)
        self._refresh()
        R = self._cap[0]
        # The call's state: the prefill's cache repeated to each prompt's rows, the mask of its columns (the rest -inf
        # until written), positions, the uniforms, the first token sampled from the prefill's logits.
        for layer, kbuf, vbuf in zip(cache.layers, self.keys, self.values):
            kbuf[:B, :, :p].copy_(layer.keys.repeat_interleave(group, dim=0))
            vbuf[:B, :, :p].copy_(layer.values.repeat_interleave(group, dim=0))
        self.bias.fill_(float("-inf"))
        self.bias[:B, 0, 0, :p] = torch.where(attn.repeat_interleave(group, dim=0) > 0, 0.0, float("-inf"))
        self.bias[B:, 0, 0, 0] = 0.0  # spare rows attend to one (zero) column: finite, never read
        self.pos[:B] = attn.sum(-1).repeat_interleave(group)
        self.col.fill_(p)
        self.stepi.fill_(1)
        self.rowmap.fill_(R)
        self.rowmap[:B] = torch.arange(B, device=dev)
        self.out_tok.fill_(self.pad_id)
        self.out_lp.zero_()
        if sp.temperature > 0:
            self.u[:L, :B] = torch.rand((L, B), generator=rng, device=dev)
        tok, lp = pick(logits, sp, None if sp.temperature <= 0 else self.u[0, :B])
        self.out_tok[:B, 0], self.out_lp[:B, 0] = tok, lp
        self.tok.fill_(self.pad_id)
        self.tok[:B] = tok
        self.live.zero_()
        self.live[:B] = (tok[:, None] != self.stop[None, :]).all(-1)
        b, i = bucket_for(B), 1
        while i < L:
            for _ in range(min(CHECK_EVERY, L - i)):
                # A weight load waiting runs here, before column i, without waiting for the GPU: its copies are
                # queued on this stream after the replays already queued, so column i is the new weights'.
                if boundary is not None and boundary(i):
                    self._refresh()
                self._run_step(b, sp)
                i += 1
            if i >= L:
                break
            n_live = int(self.live[:b].sum())  # the one synchronisation of CHECK_EVERY steps
            if n_live == 0:
                break
            if bucket_for(n_live) < b:
                b = self._compact(b, bucket_for(n_live))
        toks, lps = self.out_tok[:B, :i].cpu(), self.out_lp[:B, :i].cpu()
        return _trim(toks, lps, self.stop_ids)

    def _compact(self, b: int, nb: int) -> int:
        """Move the live rows of the first `b` to the front and decode `nb` rows from now on; returns `nb`."""
        idx = self.live[:b].nonzero().squeeze(-1)
        k = len(idx)
        for bufs in (self.keys, self.values):
            for buf in bufs:
                buf[:k] = buf.index_select(0, idx)
        for t in (self.bias, self.pos, self.tok, self.rowmap, self.live):
            t[:k] = t.index_select(0, idx)
        self.rowmap[k:nb] = self._cap[0]  # spare rows: output to the spare row, never live
        self.live[k:nb] = False
        self.tok[k:nb] = self.pad_id
        return nb

    def info(self) -> dict:
        kernels = None if self.fused is None else ("triton" if self.fused.kernels else self.fused.kernels_why)
        return {"loop": "graphs" if self.graphs and self.fallback is None else "static", "fused": self.fuse,
                "kernels": kernels, "capture_s": round(self.capture_seconds, 3), "captures": self.captures,
                "fallback": self.fallback, "buffer_rows": self._cap[0], "buffer_width": self._cap[1]}


def _trim(toks: torch.Tensor, lps: torch.Tensor, stop_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the trailing columns after every row's stop token (the eager loop stops there): the width is the latest
    row's first stop + 1, or all columns when a row never stopped."""
    if not stop_ids or toks.shape[1] == 0:
        return toks, lps
    is_stop = torch.isin(toks, torch.tensor(stop_ids))
    stopped = is_stop.any(-1)
    if not bool(stopped.all()):
        return toks, lps
    width = int(is_stop.float().argmax(-1).max()) + 1
    return toks[:, :width], lps[:, :width]
