"""maskgrpo-ray: Mask-GRPO for masked generative text-to-image models, on Ray."""

__version__ = "0.1.0"
