"""The K loop shared by the matmul kernels: one output tile accumulated by WGMMA over blocks
of K that TMA copies stream into shared memory, several blocks in flight.

`stream_tile(acc_ref, lhs_ref, rhs_ref, ...)` adds lhs[rows, ks] @ rhs[ks, cols] to the
accumulator for the K blocks ks = k_first .. k_first + k_steps - 1. The grouped matmul's tile
kernel (`grouped_matmul.tile_grouped_matmul`) and the stacked matmul
(`stacked_matmul.stacked_matmul`) both run their products through it, so the pipeline's
synchronisation lives in one place:

- WGMMA is asynchronous: it reads its operands from shared memory after it is issued. A
  buffer may be refilled by the next copy only once the WGMMA that reads it has retired.
- Each step therefore issues its WGMMA, then waits until at most that one is in flight
  (`wgmma_wait(1)`), which retires the previous step's; the copies are released one step late
  (`delay_release=1`), so the buffer refilled at step s is step s-1's, whose WGMMA is done.
- Releasing a step's own buffers at once (`delay_release=0`) with no wait lets the refill race
  the WGMMA still reading them: products come out wrong now and then, at any size, and only
  on the hardware (interpret mode runs each WGMMA to completion before the next statement).
"""

from __future__ import annotations

# The WGMMAs a step may leave in flight, and how late its buffers are released: the two must
# match (see the module text); tests read these when checking the kernels' traces.
WGMMA_IN_FLIGHT = 1
DELAY_RELEASE = WGMMA_IN_FLIGHT


def stream_tile(
    acc_ref,
    lhs_ref,
    rhs_ref,
    *,
    row_block,
    col_block,
    k_first,
    k_steps: int,
    block_k: int,
    stages: int,
) -> None:
    """acc_ref [bm, bn] += lhs_ref[row_block * bm + (0..bm), K blocks] @ rhs_ref[K blocks,
    col_block * bn + (0..bn)] over K blocks k_first .. k_first + k_steps - 1 of `block_k`,
    `stages` blocks of copies in flight (> DELAY_RELEASE). Rows of lhs past its end read as 0.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bm, bn = acc_ref.shape

    def step(_, a, b):
        plgpu.wgmma(acc_ref, a, b)
        plgpu.wgmma_wait(WGMMA_IN_FLIGHT)

    plgpu.emit_pipeline(
        step,
        grid=(k_steps,),
        in_specs=[
            plgpu.BlockSpec(
                (bm, block_k), lambda kb: (row_block, k_first + kb), delay_release=DELAY_RELEASE
            ),
            plgpu.BlockSpec(
                (block_k, bn), lambda kb: (k_first + kb, col_block), delay_release=DELAY_RELEASE
            ),
        ],
        max_concurrent_steps=stages,
    )(lhs_ref, rhs_ref)
