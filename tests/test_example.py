"""The examples: train_reverse.py's hand-written backward, through numflash, trains the model
(plain, with a softcap and with ALiBi);
jax_train.py trains inside jax.jit along jax.nn.dot_product_attention's loss curve, and
jax_decode.py decodes over paged caches in a jitted loop as one causal pass computes;
ring_train.py gives its loss and gradients with the sequence split over ranks; decode_graph.py
generates the same tokens eagerly and from a CUDA graph; sinks_decode.py's decoding loop with
sinks and a window agrees with one pass over the whole sequences; document_mask.py's block-masked
calls agree with attention_varlen."""

import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import train_reverse  # noqa: E402


@pytest.mark.parametrize(
    "softcap, alibi", [(0.0, False), (0.5, False), (0.0, True)], ids=["plain", "softcap", "alibi"]
)
def test_gradient_steps_lower_the_loss_on_a_fixed_batch(softcap, alibi):
    """Six Adam steps on one batch (tiny sizes: this runs in the simulator on CI); with the
    attention's scores capped as Gemma 2 caps them too (here a tight 0.5), or biased by
    BLOOM's ALiBi, the forward and backward given the same values."""
    xp = train_reverse.xp
    rng = np.random.default_rng(3)
    params = train_reverse.init_params(rng, vocab=4, seqlen=8, dim=16)
    opt = train_reverse.Adam(params, lr=3e-2)
    tokens = xp.asarray(rng.integers(0, 4, size=(2, 8)))
    targets = tokens[:, ::-1].copy()
    losses = []
    for _ in range(6):
        loss, _, grads = train_reverse.loss_and_grads(params, tokens, targets, 2, softcap, alibi)
        assert set(grads) == set(params)
        for name, g in grads.items():
            assert g.shape == params[name].shape and bool(xp.isfinite(g).all()), name
        opt.step(params, grads)
        losses.append(loss)
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.gpu
def test_example_learns_to_reverse_within_a_minute():
    start = time.perf_counter()
    history = train_reverse.train(out=lambda line: None)  # the defaults: 300 steps
    elapsed = time.perf_counter() - start
    assert elapsed < 60, elapsed
    assert history[-1][1] < 0.25 * math.log(16), history[-1]


def test_sinks_decode_example_agrees_with_one_pass_over_the_whole_sequences():
    """examples/sinks_decode.py at tiny sizes: a prompt through chunked prefill, then steps of
    one token, with sinks and a sliding window over a paged cache; it exits with an error if
    the steps differ from attention over the whole sequences."""
    import sinks_decode

    diff = sinks_decode.main(["--batch", "2", "--prompt", "21", "--steps", "2", "--window", "9"])
    assert diff < 4e-3


def test_document_mask_example_agrees_with_attention_varlen():
    """examples/document_mask.py at tiny sizes (one block: tests/test_block_masks.py skips
    tiles): documents packed in one sequence through a mask_mod and its block mask; it exits
    with an error if its outputs or gradients differ from attention_varlen's."""
    import document_mask

    sizes = ["--documents", "3", "--min-len", "5", "--max-len", "20", "--head-dim", "8"]
    diff = document_mask.main(sizes)
    assert diff < 2e-2


@pytest.mark.gpu
def test_decode_graph_example_generates_the_same_tokens_eagerly_and_from_its_graph():
    """examples/decode_graph.py at tiny sizes: it exits with an error if the graph's tokens
    differ from the eager loop's."""
    import decode_graph

    eager, graphed = decode_graph.main(
        ["--layers", "2", "--batch", "3", "--prompt", "40", "--steps", "5", "--vocab", "64"]
    )
    assert eager[0].shape == (5, 3) and (eager[0] == graphed[0]).all()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch", "0"], "--batch must be in"),
        (["--batch", "49"], "--batch must be in"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--vocab", "7"], "--vocab must be even"),
    ],
)
def test_decode_graph_refuses_sizes_it_cannot_run(argv, message, capsys):
    """Checked before anything touches the GPU (so this runs in the simulator too)."""
    import decode_graph

    with pytest.raises(SystemExit):
        decode_graph.main(argv)
    assert message in capsys.readouterr().err


def test_ring_training_gives_the_loss_and_gradients_of_one_device():
    """examples/ring_train.py: the sequence split over two ranks (a LocalRing of threads), the
    loss and every parameter gradient of one batch as train_reverse computes them whole (tiny
    sizes: the simulator runs this on CI)."""
    import ring_train

    xp = train_reverse.xp
    rng = np.random.default_rng(5)
    params = train_reverse.init_params(rng, vocab=4, seqlen=8, dim=16)
    tokens = xp.asarray(rng.integers(0, 4, size=(2, 8)))
    targets = tokens[:, ::-1].copy()
    loss, accuracy, grads = ring_train.ring_loss_and_grads(
        params, tokens, targets, 2, ring_train.make_rings(2, nccl=False)
    )
    whole_loss, whole_accuracy, whole = train_reverse.loss_and_grads(params, tokens, targets, 2)
    assert abs(loss - whole_loss) <= 2e-4 * whole_loss and accuracy == whole_accuracy
    assert set(grads) == set(whole)
    for name, g in grads.items():
        scale = float(xp.abs(whole[name]).max()) or 1.0
        assert float(xp.abs(g - whole[name]).max()) <= 5e-3 * scale, name  # fp16 attention


def _jax_backend_or_skip():
    """Skip unless JAX is installed with the backend numflash runs on here (CPU in the
    simulator, GPU on a GPU), as tests/test_jax.py does."""
    jax = pytest.importorskip("jax")
    from numflash.kernels.jit import SIMULATOR

    if jax.default_backend() != ("cpu" if SIMULATOR else "gpu"):
        pytest.skip(f"JAX's {jax.default_backend()} backend does not match")


def test_jax_example_trains_numflash_inside_jit_along_the_jax_attention_curve():
    """examples/jax_train.py: a jitted train step with numflash.jax.attention (forward and
    backward inside XLA's program) follows the loss curve of jax.nn.dot_product_attention
    from the same parameters and batches, and the loss falls (tiny sizes: on CI, JAX's CPU
    backend and the simulator)."""
    _jax_backend_or_skip()
    import jax_train

    losses = jax_train.train(steps=8, batch=4, seqlen=8, dim=32, heads=2, vocab=4, out=print)
    for a, b in zip(losses["numflash"], losses["jax"]):
        assert abs(a - b) < 0.02 * max(1.0, abs(b)), losses  # bf16 q, k, v either way
    assert min(losses["numflash"][-3:]) < 0.75 * losses["numflash"][0], losses


def test_jax_decode_example_matches_one_causal_pass_across_pages():
    """examples/jax_decode.py: a jitted fori_loop of decoding steps over paged caches (carried
    and donated, appended in place by numflash.jax.attention_with_kvcache) gives the logits of
    one causal pass over the generated sequence; 17 tokens cross a 16-token page."""
    _jax_backend_or_skip()
    import jax_decode

    tokens, gap, scale = jax_decode.run(
        batch=2, layers=2, prompt_len=3, new=14, dim=32, heads=2, kv_heads=1, vocab=8, out=print
    )
    assert tokens.shape == (2, 17)
    assert gap <= 0.02 * scale, (gap, scale)  # bf16 q, k, v and outputs either way
