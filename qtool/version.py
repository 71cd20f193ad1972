"""qtool's version: a fact that writers stamp into what they write (`general.quantized_by`)."""

__version__ = "0.1.0"
