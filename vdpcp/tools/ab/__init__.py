"""The feature's A/B (`vdpcp ab`): a tiny VLM trained twice, vision_dp_over_cp on and off, held to each other.

    stream.py  the run's microbatches: dataset draws, placeholder and remainder ones mixed in, text around them
    vlm.py     the implementation's tower + projector, a small causal LM (vdpcp.tools.ab.lm), the per-rank zigzag loss
    optim.py   gradients summed over CP, AdamW (float32 main weights under bf16)
    train.py   on every CP rank: both arms from the same weights on the same data
    judge.py   the dtype's tolerance, and pass or fail
    report.py  table, JSON, PNG

`python -m vdpcp.tools.ab ...` is `vdpcp ab ...`; neither imports megatron-core unless --impl mcore asks for it.
"""
