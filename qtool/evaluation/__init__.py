"""What quantization does to a model's outputs: `qtool eval` and `compare --text`.

Two checkpoints run in lockstep on the calibration runner's layers, one decoder layer of each in
memory at a time, their next-token distributions compared window by window (perplexity, KL
divergence, top-1 agreement) and their hidden states layer by layer.
"""
