"""Calibrated quantization: GPTQ from the activations each Linear sees on real text, one
decoder layer in memory at a time (DESIGN.md, "Calibration"). The results enter the write
plan as precomputed encodings; the one executor writes them as it writes any other."""
