"""FX graph passes that put DMA attention into compiled models.

`dma_compile.passes.rewrite_sdpa` rewrites SDPA call sites into the
`dma::attention` op; `dma_compile.backend` runs it as a torch.compile backend
and as an Inductor custom pass.
"""
