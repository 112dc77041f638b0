"""The simulator's block scheduler, made to poll without holding the interpreter.

Numba's CUDA simulator runs a block's threads as Python threads, and its block manager
watches them from the launching thread in a loop with no pause: asking every thread whether
it is alive or waiting at ``syncthreads`` tens of millions of times a kernel, that thread
takes the GIL from the block's threads as often as they do. poll_blocks_gently replaces the
manager's ``run`` with a loop that sleeps between looks and otherwise does what the
simulator documents: start every thread, release them all when every live thread waits at
``syncthreads``, abort them all and raise the first exception a thread raised.
"""

import time

import numpy as np

#: Seconds between looks at a block's threads.
POLL_INTERVAL = 2e-4


def poll_blocks_gently(interval=POLL_INTERVAL):
    """Install the gentler block loop into numba-cuda's simulator (call before any launch)."""
    from numba.cuda.simulator import kernel as simulated

    def run(manager, grid_point, *args):
        def body():
            manager._f(*args)

        threads = [
            simulated.BlockThread(body, manager, grid_point, point, manager._debug)
            for point in np.ndindex(*manager._block_dim)
        ]
        for t in threads:
            t.start()
        live = threads
        while live:
            time.sleep(interval)
            failed = next((t for t in threads if t.exception), None)
            if failed is not None:
                for t in threads:  # wake every thread at a barrier to see the abort flag
                    t.abort = True
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                raise failed.exception[0].with_traceback(failed.exception[1])
            live = [t for t in live if t.is_alive()]
            if live and all(t.syncthreads_blocked for t in live):
                for t in live:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
        failed = next((t for t in threads if t.exception), None)
        if failed is not None:
            raise failed.exception[0].with_traceback(failed.exception[1])
        return False

    simulated.BlockManager.run = run
