"""Galaxy's Transformer blocks, reference model and weight sources.

The coordinator reads a trained checkpoint's config through `sources`; the workers
load and shard weights and run the blocks. The executor itself is in
`services.worker.galaxy`.
"""
