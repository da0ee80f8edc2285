"""GdsLLM from Python: models, zero-copy tensors for NumPy and PyTorch, and the engine.

    import gdsllm
    m = gdsllm.open("smollm2.gds")                  # a model directory, a .gguf or a registry ref
    w = m["blk.0.attn_q.weight"].dequantize()        # float32 NumPy array (gds-kernels)
    print(gdsllm.Engine("smollm2.gds", temperature=0).generate("Hi", max_tokens=16))

See docs/python.md.
"""

from ._gdsllm import (  # noqa: F401
    CUDA,
    Engine,
    GdsError,
    Model,
    Stream,
    Tensor,
    convert,
    open,
    pull,
    resolve,
)

__all__ = [
    "CUDA",
    "Engine",
    "GdsError",
    "Model",
    "Stream",
    "Tensor",
    "convert",
    "open",
    "pull",
    "resolve",
]
