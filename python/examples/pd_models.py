"""The two models the P/D example runs, behind one small interface.

    model.prefill(tokens)     -> kv: per layer (K, V), each [kv_heads, seq, head_dim]
    model.decode(kv, tokens, n, on_first=None, logits=None) -> n greedy tokens

``decode`` continues from a cache ``kv`` that covers a *strict* prefix of
``tokens`` (at least one prompt token is always computed: a cache covering
the whole prompt leaves no logits to pick the first token from), computes
the rest of the prompt in one forward, then decodes greedily. ``on_first``
is called when the first token is known (time to first token); ``logits``,
a list, receives a copy of each step's last-position logits (to compare two
runs bit for bit).

- :class:`NumpyDecoder`: a small reference decoder in numpy (RMSNorm, RoPE,
  grouped-query attention, SwiGLU), float32. What CI runs: torch is several
  GB, numpy a few MB.
- :class:`QwenModel`: transformers' Qwen3 architecture with seeded random
  weights (nothing can be downloaded), bf16 on CUDA. Its cache is
  transformers' ``DynamicCache`` (``[batch, kv_heads, seq, head_dim]`` per
  layer), converted to and from the per-layer (K, V) form above. It runs
  under :func:`cuda_determinism` (see there: which settings, and why).

Each model also says how to move KV between that form and a paged cache
``[num_blocks, block_tokens, kv_heads, head_dim]`` (vLLM's "NHD"), and
compares two caches or two logits traces bit for bit.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

KV = List[Tuple[Any, Any]]


class NumpyDecoder:
    """A seeded random decoder-only transformer in numpy (float32)."""

    dtype_name = "float32"

    def __init__(self, *, vocab=512, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, inter=256, seed=0):
        self.vocab, self.hidden, self.num_layers = vocab, hidden, layers
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        rng = np.random.default_rng(seed)

        def w(*shape, scale=None):
            s = scale if scale is not None else 1.0 / np.sqrt(shape[0])
            return (rng.standard_normal(shape) * s).astype(np.float32)

        self.embed = w(vocab, hidden, scale=1.0)
        self.layers = []
        for _ in range(layers):
            self.layers.append(
                dict(
                    ln1=np.ones(hidden, np.float32) + w(hidden, scale=0.1),
                    wq=w(hidden, heads * head_dim),
                    wk=w(hidden, kv_heads * head_dim),
                    wv=w(hidden, kv_heads * head_dim),
                    wo=w(heads * head_dim, hidden),
                    ln2=np.ones(hidden, np.float32) + w(hidden, scale=0.1),
                    wg=w(hidden, inter),
                    wu=w(hidden, inter),
                    wd=w(inter, hidden),
                )
            )
        self.ln_f = np.ones(hidden, np.float32)
        self.lm_head = w(hidden, vocab)
        inv = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        self._inv_freq = inv

    def fingerprint(self) -> str:
        """Digest of the weights (both sides must build the same model)."""
        h = hashlib.sha256(self.embed.tobytes())
        h.update(self.layers[-1]["wd"].tobytes())
        return h.hexdigest()[:16]

    @staticmethod
    def _rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g

    def _rope(self, x, pos):  # x [h, s, d]
        ang = np.outer(pos, self._inv_freq)  # [s, d/2]
        cos = np.concatenate([np.cos(ang), np.cos(ang)], -1).astype(np.float32)
        sin = np.concatenate([np.sin(ang), np.sin(ang)], -1).astype(np.float32)
        half = x.shape[-1] // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def _forward(self, tokens: Sequence[int], kv: KV) -> Tuple[np.ndarray, KV]:
        """Runs ``tokens`` after the cache ``kv``; last position's logits and
        the extended cache."""
        start = kv[0][0].shape[1] if kv else 0
        n = len(tokens)
        pos = np.arange(start, start + n)
        x = self.embed[np.asarray(tokens)]
        group = self.heads // self.kv_heads
        mask = np.triu(np.full((n, start + n), -np.inf, np.float32), k=start + 1)
        out_kv: KV = []
        for i, L in enumerate(self.layers):
            h = self._rms(x, L["ln1"])
            q = (h @ L["wq"]).reshape(n, self.heads, self.head_dim).transpose(1, 0, 2)
            k = (h @ L["wk"]).reshape(n, self.kv_heads, self.head_dim).transpose(1, 0, 2)
            v = (h @ L["wv"]).reshape(n, self.kv_heads, self.head_dim).transpose(1, 0, 2)
            q, k = self._rope(q, pos), self._rope(k, pos)
            if kv:
                k = np.concatenate([kv[i][0], k], axis=1)
                v = np.concatenate([kv[i][1], v], axis=1)
            k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
            out_kv.append((k, v))
            kk = np.repeat(k, group, axis=0)
            vv = np.repeat(v, group, axis=0)
            s = q @ kk.transpose(0, 2, 1) / np.sqrt(self.head_dim) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            a = (s @ vv).transpose(1, 0, 2).reshape(n, -1)
            x = x + a @ L["wo"]
            h = self._rms(x, L["ln2"])
            g = h @ L["wg"]
            x = x + ((g / (1 + np.exp(-g))) * (h @ L["wu"])) @ L["wd"]
        logits = self._rms(x[-1:], self.ln_f) @ self.lm_head
        return logits[0], out_kv

    def prefill(self, tokens: Sequence[int]) -> KV:
        return self._forward(list(tokens), [])[1]

    def decode(
        self,
        kv: KV,
        tokens: Sequence[int],
        n: int,
        on_first: Optional[Callable[[], None]] = None,
        logits: Optional[list] = None,
    ) -> List[int]:
        c = kv[0][0].shape[1] if kv else 0
        assert c < len(tokens), "the cache must leave at least one prompt token to compute"
        step_logits, kv = self._forward(list(tokens[c:]), kv)
        out: List[int] = []
        for step in range(n):
            t = int(np.argmax(step_logits))
            out.append(t)
            if step == 0 and on_first:
                on_first()
            if logits is not None:
                logits.append(step_logits.copy())
            if step + 1 < n:
                step_logits, kv = self._forward([t], kv)
        return out

    # -- paged cache ----------------------------------------------------
    def new_paged(self, num_blocks: int, block_tokens: int):
        shape = (num_blocks, block_tokens, self.kv_heads, self.head_dim)
        return [np.zeros(shape, np.float32) for _ in range(self.num_layers)], [
            np.zeros(shape, np.float32) for _ in range(self.num_layers)
        ]

    @staticmethod
    def to_paged(kv: KV, pk, pv, nblocks: int, bt: int) -> None:
        """Blocks ``0..nblocks`` of the paged cache ← tokens ``0..nblocks*bt``."""
        for (k, v), dk, dv in zip(kv, pk, pv):
            h, _, d = k.shape
            dk[:nblocks] = k[:, : nblocks * bt].reshape(h, nblocks, bt, d).transpose(1, 2, 0, 3)
            dv[:nblocks] = v[:, : nblocks * bt].reshape(h, nblocks, bt, d).transpose(1, 2, 0, 3)

    @staticmethod
    def from_paged(pk, pv, nblocks: int, bt: int) -> KV:
        out = []
        for dk, dv in zip(pk, pv):
            _, _, h, d = dk.shape
            k = np.ascontiguousarray(dk[:nblocks].transpose(2, 0, 1, 3).reshape(h, nblocks * bt, d))
            v = np.ascontiguousarray(dv[:nblocks].transpose(2, 0, 1, 3).reshape(h, nblocks * bt, d))
            out.append((k, v))
        return out

    @staticmethod
    def block_digests(pk, pv, nblocks: int) -> List[str]:
        """Per block, a digest of its bytes (all layers, K and V). Blocks are
        hashed on several threads (hashlib releases the GIL): 1.2 GB of KV
        takes seconds on one."""

        def one(b: int) -> str:
            h = hashlib.blake2b(digest_size=16)
            for dk, dv in zip(pk, pv):
                h.update(np.ascontiguousarray(dk[b]))
                h.update(np.ascontiguousarray(dv[b]))
            return h.hexdigest()

        if nblocks < 16:
            return [one(b) for b in range(nblocks)]
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            return list(pool.map(one, range(nblocks)))

    @staticmethod
    def kv_equal(a: KV, b: KV) -> bool:
        """Two caches of per-layer (K, V), bit for bit (shapes included)."""
        return len(a) == len(b) and all(
            x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()
            for (ka, va), (kb, vb) in zip(a, b)
            for x, y in ((ka, kb), (va, vb))
        )

    @staticmethod
    def logits_equal(a: list, b: list) -> bool:
        """Two decode logits traces, bit for bit."""
        return len(a) == len(b) and all(x.tobytes() == y.tobytes() for x, y in zip(a, b))

    def determinism(self) -> dict:
        return {"model": "numpy float32", "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS")}

    def sync(self) -> None:
        pass


# cuBLAS picks the same kernels, with the same reduction order, on every call
# only with a fixed workspace per stream; the values it accepts.
CUBLAS_WORKSPACE_CONFIGS = (":4096:8", ":16:8")


def cuda_determinism_env() -> None:
    """What must be in the environment before CUDA starts in a process
    (the example calls it before it starts any worker; ``spawn`` workers
    inherit it)."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_WORKSPACE_CONFIGS:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIGS[0]
    # TunableOp's variable overrides its Python switch (see cuda_determinism).
    os.environ["PYTORCH_TUNABLEOP_ENABLED"] = "0"


def cuda_determinism(torch) -> dict:
    """Makes the Qwen3 forward bit-reproducible on CUDA; returns what it set.

    Why each setting:

    - ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (before CUDA starts): cuBLAS is
      bit-reproducible run to run only while one stream is active; with
      several (kvferry's CUDA backend loads on streams of its own in the
      same process) it may pick other internal implementations, unless the
      workspace is fixed by this variable (cuBLAS "Results
      reproducibility"). A likely cause of the decode process's recompute
      that changed within one process on the H200 (2026-12-01).
    - ``torch.use_deterministic_algorithms(True, warn_only=True)``:
      deterministic implementations wherever torch has a choice. An op
      with none warns instead of aborting the run; the warnings seen while
      the model warms up are reported (the in-run proof judges, not this
      flag). ``fill_uninitialized_memory`` off: NaN-filling every new
      tensor would slow both timed paths and changes nothing in a forward
      that writes all of its outputs.
    - TF32 off (``allow_tf32``, cuDNN's too, matmul precision "highest"):
      the fp32 parts (RoPE's angles) round the same way everywhere.
    - No autotuning (a choice by timing can differ between processes):
      cuDNN deterministic and no cuDNN benchmark; PyTorch's TunableOp off,
      its variable ``PYTORCH_TUNABLEOP_ENABLED=0`` too (the variable beats
      the switch); cuDNN's SDPA backend off (its plan is cuDNN's heuristic).
    - Attention ``sdpa``, served by PyTorch's flash and memory-efficient
      kernels: their forwards reduce in a fixed order (no atomics), so they
      are deterministic for a given shape. ``eager`` (or SDPA's math
      backend) is no more reproducible but materialises the scores, 32 x
      8192 x 8192 in fp32 per layer at 8,192 tokens: a slower recompute,
      which would flatter T9 and the handoff ratio.

    What makes the comparison exact is the harness, not these flags alone:
    the reference and the P/D path run identical operations on identical
    inputs (``pd_real_model.py``), and the reference is computed twice in
    the run and must agree with itself bit for bit before it judges.
    """
    cuda_determinism_env()
    torch.use_deterministic_algorithms(True, warn_only=True)
    det = getattr(getattr(torch, "utils", None), "deterministic", None)
    if det is not None and hasattr(det, "fill_uninitialized_memory"):
        det.fill_uninitialized_memory = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    tunable = getattr(torch.cuda, "tunable", None)
    if tunable is not None:
        tunable.enable(False)
    cudnn_sdp = getattr(torch.backends.cuda, "enable_cudnn_sdp", None)
    if cudnn_sdp is not None:
        cudnn_sdp(False)
    return {
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "fill_uninitialized_memory": getattr(det, "fill_uninitialized_memory", None),
        "tf32": [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32],
        "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "tunableop": tunable.is_enabled() if tunable is not None else None,
        "cudnn_sdp": getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: None)(),
        "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient_sdp": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math_sdp": torch.backends.cuda.math_sdp_enabled(),
        "torch": torch.__version__,
    }


class QwenModel:
    """transformers' Qwen3 with seeded random weights, bf16 on CUDA.

    ``device="cpu"`` runs the same code on the CPU (a check of this path
    without a GPU; slow, and not what the timings are about)."""

    dtype_name = "bfloat16"
    # See cuda_determinism: sdpa's flash / memory-efficient forwards are
    # deterministic and as fast as a serving engine's attention.
    attn_implementation = "sdpa"

    def __init__(self, *, size: str = "small", seed: int = 0, device: str = "cuda", paged_device: str = "cuda"):
        if device == "cuda":
            cuda_determinism_env()  # before torch starts CUDA
        import torch
        import transformers
        from transformers import Qwen3Config, Qwen3ForCausalLM

        self.torch = torch
        self.device = device
        self.paged_device = paged_device
        self._determinism = cuda_determinism(torch) if device == "cuda" else {"torch": torch.__version__}
        self._determinism["transformers"] = transformers.__version__
        if size == "large":
            # Qwen3-8B's dimensions (36 layers, 32 query / 8 KV heads x 128,
            # hidden 4096, MLP 12288), so both the KV bytes and the prefill
            # compute a fetch competes with are an 8B model's; a 32k
            # vocabulary instead of 152k (the embedding does not touch KV).
            cfg = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32)
        else:
            cfg = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8)
        config = Qwen3Config(
            vocab_size=32000,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=16384,
            rope_theta=1_000_000.0,
            tie_word_embeddings=False,
            **cfg,
        )
        config._attn_implementation = self.attn_implementation
        torch.manual_seed(seed)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # build in bf16 on the device: no fp32 copy of 8B weights
        try:
            with torch.device(device):
                model = Qwen3ForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
        self.model = model.to(dtype=torch.bfloat16).eval()
        self._determinism["attn_implementation"] = self.model.config._attn_implementation
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.vocab = config.vocab_size

    def determinism(self) -> dict:
        return dict(self._determinism)

    def fingerprint(self) -> str:
        t = self.torch
        acc = hashlib.sha256()
        for p in list(self.model.parameters())[:3] + list(self.model.parameters())[-2:]:
            acc.update(p.detach().flatten()[:4096].view(t.int16).cpu().numpy().tobytes())
        return acc.hexdigest()[:16]

    def sync(self) -> None:
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()

    def _cache(self, kv: KV):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i, (k, v) in enumerate(kv):
            cache.update(k[None].to(self.device), v[None].to(self.device), i)
        return cache

    @staticmethod
    def _layers(cache) -> KV:
        if hasattr(cache, "layers"):
            return [(layer.keys[0], layer.values[0]) for layer in cache.layers]
        return [(k[0], v[0]) for k, v in zip(cache.key_cache, cache.value_cache)]

    def prefill(self, tokens: Sequence[int]) -> KV:
        t = self.torch
        with t.inference_mode():
            ids = t.tensor([list(tokens)], device=self.device)
            out = self.model(input_ids=ids, use_cache=True)
            return self._layers(out.past_key_values)

    def decode(
        self,
        kv: KV,
        tokens: Sequence[int],
        n: int,
        on_first: Optional[Callable[[], None]] = None,
        logits: Optional[list] = None,
    ) -> List[int]:
        t = self.torch
        c = int(kv[0][0].shape[1]) if kv else 0
        assert c < len(tokens), "the cache must leave at least one prompt token to compute"
        with t.inference_mode():
            cache = self._cache(kv)
            ids = t.tensor([list(tokens[c:])], device=self.device)
            out: List[int] = []
            for step in range(n):
                res = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
                cache = res.past_key_values
                last = res.logits[0, -1]
                nxt = int(last.argmax())
                out.append(nxt)
                if step == 0 and on_first:
                    on_first()
                if logits is not None:
                    logits.append(last.clone())
                ids = t.tensor([[nxt]], device=self.device)
            return out

    def kv_equal(self, a: KV, b: KV) -> bool:
        """Two caches of per-layer (K, V), bit for bit (on the device)."""
        t = self.torch
        return len(a) == len(b) and all(
            x.shape == y.shape and x.dtype == y.dtype and t.equal(_bits(t, x), _bits(t, y))
            for (ka, va), (kb, vb) in zip(a, b)
            for x, y in ((ka, kb), (va, vb))
        )

    def logits_equal(self, a: list, b: list) -> bool:
        """Two decode logits traces, bit for bit."""
        t = self.torch
        return len(a) == len(b) and all(
            x.shape == y.shape and x.dtype == y.dtype and t.equal(_bits(t, x), _bits(t, y)) for x, y in zip(a, b)
        )

    # -- paged cache ----------------------------------------------------
    def new_paged(self, num_blocks: int, block_tokens: int):
        t = self.torch
        shape = (num_blocks, block_tokens, self.kv_heads, self.head_dim)
        kw = dict(dtype=t.bfloat16, device=self.paged_device)
        if self.paged_device == "cpu" and t.cuda.is_available():
            kw["pin_memory"] = True
        return [t.zeros(shape, **kw) for _ in range(self.num_layers)], [
            t.zeros(shape, **kw) for _ in range(self.num_layers)
        ]

    @staticmethod
    def to_paged(kv: KV, pk, pv, nblocks: int, bt: int) -> None:
        for (k, v), dk, dv in zip(kv, pk, pv):
            h, _, d = k.shape
            dk[:nblocks].copy_(k[:, : nblocks * bt].reshape(h, nblocks, bt, d).permute(1, 2, 0, 3))
            dv[:nblocks].copy_(v[:, : nblocks * bt].reshape(h, nblocks, bt, d).permute(1, 2, 0, 3))

    def from_paged(self, pk, pv, nblocks: int, bt: int) -> KV:
        out = []
        for dk, dv in zip(pk, pv):
            _, _, h, d = dk.shape
            k = dk[:nblocks].permute(2, 0, 1, 3).reshape(h, nblocks * bt, d).to(self.device).contiguous()
            v = dv[:nblocks].permute(2, 0, 1, 3).reshape(h, nblocks * bt, d).to(self.device).contiguous()
            out.append((k, v))
        return out

    def block_digests(self, pk, pv, nblocks: int) -> List[str]:
        t = self.torch
        ks = [dk[:nblocks].view(t.int16).cpu().numpy() for dk in pk]
        vs = [dv[:nblocks].view(t.int16).cpu().numpy() for dv in pv]
        return NumpyDecoder.block_digests(ks, vs, nblocks)


def _bits(torch, x):
    """``x``'s bytes as integers (``equal`` on floats calls -0 == 0 and NaN != NaN)."""
    return x.contiguous().view(torch.uint8)


def build(device: str, size: str, paged_device: Optional[str] = None, model: Optional[str] = None):
    """The model for ``--device`` (``cpu``: numpy; ``cuda``: Qwen3);
    ``model="qwen"`` runs Qwen3 on the CPU too (a check of that path)."""
    if device == "cpu" and model != "qwen":
        if size == "large":
            return NumpyDecoder(hidden=256, layers=8, heads=8, kv_heads=4, head_dim=32, inter=512)
        return NumpyDecoder()
    return QwenModel(size=size, device=device, paged_device=paged_device or device)
