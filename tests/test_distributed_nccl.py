"""numflash.distributed over NCCL between GPUs of one process (one thread a GPU, communicators
from nccl_communicators), against the float64 reference on the whole sequence. Needs two GPUs
(the H200 x2 machine); skipped elsewhere."""

import numpy as np
import pytest
from support import assert_gradients_match, assert_matches_reference, random_array

from numflash import distributed
from numflash.kernels.jit import SIMULATOR

pytestmark = pytest.mark.gpu


def _gpus():
    if SIMULATOR:
        return 0
    import cupy

    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(
    "causal,window,dtype", [(True, (-1, -1), "bfloat16"), (False, (64, 64), "float16")]
)
def test_ring_over_nccl_matches_attention_on_the_whole_sequence(causal, window, dtype):
    import cupy

    world = 2
    q = random_array((2, 1024, 8, 128), dtype)  # on device 0
    k, v = (random_array((2, 1024, 2, 128), dtype) for _ in range(2))
    dout = random_array(q.shape, dtype)
    comms = distributed.nccl_communicators(list(range(world)))

    def rank_work(rank, comm):
        mine = [cupy.asarray(distributed.shard(x, rank, world).get()) for x in (q, k, v, dout)]
        mask = dict(causal=causal, window_size=window)
        out, lse = distributed.ring_attention(*mine[:3], comm, return_lse=True, **mask)
        grads = distributed.ring_attention_backward(mine[3], *mine[:3], out, lse, comm, **mask)
        cupy.cuda.get_current_stream().synchronize()
        return [x.get() for x in (out, lse, *grads)]

    results = distributed.run_ranks(rank_work, comms, devices=range(world), timeout=600)
    whole = [
        cupy.asarray(
            distributed.unshard([np.asarray(r[i]) for r in results], axis=2 if i == 1 else 1)
        )
        for i in range(5)
    ]
    out, lse, dq, dk, dv = whole
    assert_matches_reference(q, k, v, out, lse, causal=causal, window_size=window)
    assert_gradients_match(dout, q, k, v, dq, dk, dv, causal=causal, window_size=window)
