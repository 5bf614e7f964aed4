"""Tiny NVFP4 MoE checkpoints: tensor naming for both formats, and (later) the writer."""
