"""Pure Mask-GRPO math: no ray, deepspeed or torch.distributed imports."""
