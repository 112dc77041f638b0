"""A toy decoder generating tokens over a paged KV cache, eagerly and from one CUDA graph.

    python examples/decode_graph.py [--layers 32] [--batch 8] [--prompt 1024] [--steps 64]

The model: a token embedding, ``--layers`` attention layers (a fused QKV projection, numflash's
attention_with_kvcache over the layer's paged cache with the new token's k and v appended in
place, an output projection and a residual connection), then a read-out to the vocabulary and
a greedy choice of the next token. Weights are random fp16; the caches start filled with random
keys and values for ``--prompt`` tokens. The lengths live on the device and advance there, so
one captured step serves every token.

The projections are two small CuPy RawKernels (fp16 weights read once, fp32 partial sums over
slices of the inner dimension, then the partials added up in a fixed order, with the residual,
into fp16): CuPy refuses to call cuBLAS while a stream is capturing, so ``x @ w`` cannot be part
of a graph. As a serving loop does, a step writes into buffers made once (the hidden state,
the fused QKV rows and their q, k, v views, the partial sums), so the eager loop issues four
kernels and one numflash call per layer and allocates only numflash's output, which numflash
hands out again once the layer has used it.

Prints tokens/s and the time per token of the eager loop (host and GPU) and of the graph, and
checks that both generate the same tokens, bit for bit.
"""

import argparse
import time

import cupy as xp
import numpy as np

import numflash

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128

_PROJECTION = r"""
#include <cuda_fp16.h>
// part[s, r, c] = sum over k in slice s of x[r, k] * w[k, c]; one thread per two columns.
extern "C" __global__ void project(const __half* x, const __half* w, float* part,
                                   int k_dim, int n, int k_chunk) {
    extern __shared__ float xs[];  // ROWS x k_chunk
    int k0 = blockIdx.y * k_chunk;
    int len = min(k_chunk, k_dim - k0);
    for (int i = threadIdx.x; i < ROWS * len; i += blockDim.x)
        xs[i] = __half2float(x[(i / len) * k_dim + k0 + i % len]);
    __syncthreads();
    int col = 2 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (col >= n) return;
    float acc[ROWS][2] = {};
    const __half2* wp = reinterpret_cast<const __half2*>(w + (size_t)k0 * n + col);
#pragma unroll 8
    for (int j = 0; j < len; ++j) {
        float2 wf = __half22float2(wp[(size_t)j * (n / 2)]);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            acc[r][0] += xs[r * len + j] * wf.x;
            acc[r][1] += xs[r * len + j] * wf.y;
        }
    }
    float* out = part + ((size_t)blockIdx.y * ROWS) * n + col;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        out[(size_t)r * n] = acc[r][0];
        out[(size_t)r * n + 1] = acc[r][1];
    }
}

// y[i] = half(sum over s of part[s, i] (+ residual[i] if add)), the slices added in order; y
// may be the residual itself (each thread reads its element before writing it).
extern "C" __global__ void reduce(const float* part, int splits, int size,
                                  const __half* residual, int add, __half* y) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= size) return;
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) sum += part[(size_t)s * size + i];
    if (add) sum += __half2float(residual[i]);
    y[i] = __float2half(sum);
}
"""
_K_CHUNK = 256  # inner-dimension slice of one block
_THREADS = 256
MAX_BATCH = 48  # the rows' slice of x in 48 KiB of shared memory: 48 x 256 fp32


class Projection:
    """x (rows, k) fp16 @ w (k, n) fp16 (+ residual) -> y (rows, n) fp16, without cuBLAS
    (capturable), through fp32 partial sums in ``part`` (a buffer the caller keeps)."""

    def __init__(self, rows):
        module = xp.RawModule(code=_PROJECTION, options=(f"-DROWS={rows}",))
        self.kernel = module.get_function("project")
        self.reduce = module.get_function("reduce")
        self.rows = rows

    def parts(self, k):
        return -(-k // _K_CHUNK)

    def __call__(self, x, w, part, y, residual=None):
        (k, n), rows = w.shape, self.rows
        assert x.shape == (rows, k) and n % 2 == 0 and x.flags.c_contiguous
        assert y.shape == (rows, n) and y.dtype == xp.float16 and y.flags.c_contiguous
        splits = self.parts(k)
        assert part.size >= splits * rows * n and part.dtype == xp.float32
        grid = (-(-n // (2 * _THREADS)), splits)
        args = (x, w, part, np.int32(k), np.int32(n), np.int32(_K_CHUNK))
        self.kernel(grid, (_THREADS,), args, shared_mem=rows * _K_CHUNK * 4)
        size = rows * n
        add = residual is not None
        args = (part, np.int32(splits), np.int32(size), residual if add else y, np.int32(add), y)
        self.reduce((-(-size // _THREADS),), (_THREADS,), args)
        return y


class Decoder:
    """The weights, the paged caches and the decoding state (current tokens, lengths)."""

    def __init__(self, layers, batch, prompt, max_len, page, vocab, seed=0):
        rng = xp.random.default_rng(seed)
        dim = HEADS * HEAD_DIM
        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM

        def weights(*shape):
            return (rng.standard_normal(shape, dtype=xp.float32) / np.sqrt(shape[0])).astype(
                xp.float16
            )

        self.embed = weights(vocab, dim) * np.float16(np.sqrt(vocab / dim))
        self.w_qkv = [weights(dim, qkv) for _ in range(layers)]
        self.w_out = [weights(dim, dim) for _ in range(layers)]
        self.read_out = weights(dim, vocab)
        pages = -(-max_len // page)
        order = np.random.default_rng(seed).permutation(batch * pages).astype(np.int32)
        self.block_table = xp.asarray(order.reshape(batch, pages))
        shape = (batch * pages, page, KV_HEADS, HEAD_DIM)

        def cache():
            return rng.standard_normal(shape, dtype=xp.float32).astype(xp.float16)

        self.k_cache = [cache() for _ in range(layers)]
        self.v_cache = [cache() for _ in range(layers)]
        self.lengths = xp.full((batch,), prompt, dtype=xp.int32)
        self.tokens = xp.asarray(np.random.default_rng(seed).integers(0, vocab, batch), xp.int32)
        self.project = Projection(batch)
        # A step's buffers, made once: the hidden state, the fused QKV rows (q, k and v are
        # views of them), the partial sums of the widest projection.
        self.x = xp.empty((batch, dim), dtype=xp.float16)
        self.qkv = xp.empty((batch, 1, HEADS + 2 * KV_HEADS, HEAD_DIM), dtype=xp.float16)
        self.q = self.qkv[:, :, :HEADS]
        self.k = self.qkv[:, :, HEADS : HEADS + KV_HEADS]
        self.v = self.qkv[:, :, HEADS + KV_HEADS :]
        self.logits16 = xp.empty((batch, vocab), dtype=xp.float16)
        widest = max(self.project.parts(dim) * max(qkv, dim, vocab), 1)
        self.part = xp.empty(batch * widest, dtype=xp.float32)
        #: A captured step's intermediate arrays: the graph keeps using their memory, so they
        #: must not go back to CuPy's pool (numflash keeps its own buffers for a captured plan).
        self.scratch = []

    def state(self):
        return [*self.k_cache, *self.v_cache, self.lengths, self.tokens]

    def save(self):
        return [x.copy() for x in self.state()]

    def restore(self, saved, stream):
        """Put the saved state back, on ``stream``: the steps run there, and a non-blocking
        stream does not wait for work on the default one."""
        with stream:
            for x, y in zip(self.state(), saved):
                x[...] = y

    def step(self, keep=False):
        """One token for every sequence: append its k and v in every layer, attend, advance.
        ``keep``: hold on to every array the step makes (while capturing a graph)."""
        batch = self.tokens.shape[0]
        x, qkv, part = self.x, self.qkv.reshape(batch, -1), self.part
        xp.take(self.embed, self.tokens, axis=0, out=x)
        held = []
        for layer, (w_qkv, w_out) in enumerate(zip(self.w_qkv, self.w_out)):
            self.project(x, w_qkv, part, qkv)
            attended = numflash.attention_with_kvcache(
                self.q,
                self.k_cache[layer],
                self.v_cache[layer],
                self.k,
                self.v,
                cache_seqlens=self.lengths,
                block_table=self.block_table,
            )
            self.project(attended.reshape(batch, -1), w_out, part, x, residual=x)
            if keep:
                held.append(attended)
            del attended  # numflash hands it out again to the next layer
        logits = self.project(x, self.read_out, part, self.logits16)
        best = xp.argmax(logits, axis=-1)
        best32 = best.astype(xp.int32)
        held += [best, best32]
        self.tokens[...] = best32
        self.lengths += 1
        if keep:
            self.scratch += held


def run(model, stream, steps, replay=None):
    """(generated tokens (steps, batch) on the host, wall s, GPU s, host s to issue the work):
    ``steps`` eager steps, or replays of ``replay`` (a captured step)."""
    history = xp.empty((steps,) + model.tokens.shape, dtype=xp.int32)
    start, stop = xp.cuda.Event(), xp.cuda.Event()
    with stream:
        stream.synchronize()
        t0 = time.perf_counter()
        start.record(stream)
        for i in range(steps):
            if replay is None:
                model.step()
            else:
                replay.launch(stream)
            history[i] = model.tokens
        stop.record(stream)
        issued = time.perf_counter() - t0
        stop.synchronize()
        wall = time.perf_counter() - t0
    return history.get(), wall, xp.cuda.get_elapsed_time(start, stop) / 1e3, issued


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024, help="tokens already in each cache")
    ap.add_argument("--steps", type=int, default=64, help="tokens generated per sequence")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args(argv)
    if not 1 <= args.batch <= MAX_BATCH:
        ap.error(f"--batch must be in [1, {MAX_BATCH}] (the projection kernel's shared memory)")
    for name in ("layers", "prompt", "steps", "page"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.vocab < 2 or args.vocab % 2:
        ap.error("--vocab must be even and at least 2 (the projection writes column pairs)")
    model = Decoder(
        args.layers,
        args.batch,
        args.prompt,
        args.prompt + args.steps + 1,
        args.page,
        args.vocab,
    )
    start = model.save()
    xp.cuda.Device().synchronize()  # the model was made on the default stream
    stream = xp.cuda.Stream(non_blocking=True)
    with stream:
        model.step()  # compiles the kernels and makes numflash's plans for this stream
    model.restore(start, stream)
    eager = run(model, stream, args.steps)
    model.restore(start, stream)
    with stream:
        stream.begin_capture()
        model.step(keep=True)
        graph = stream.end_capture()
    graphed = run(model, stream, args.steps, replay=graph)
    if not (eager[0] == graphed[0]).all():
        raise SystemExit("the graph generated other tokens than the eager loop")
    tokens = args.steps * args.batch
    for name, (_, wall, gpu, issued) in (("eager", eager), ("graph", graphed)):
        print(
            f"{name}: {tokens / wall:8.0f} tokens/s; per step (one token per sequence): "
            f"{wall / args.steps * 1e3:.3f} ms wall, {gpu / args.steps * 1e3:.3f} ms GPU, "
            f"{issued / args.steps * 1e3:.3f} ms host to issue"
        )
    print(f"same {args.steps} x {args.batch} tokens from both")
    return eager, graphed


if __name__ == "__main__":
    main()
