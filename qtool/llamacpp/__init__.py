"""llama.cpp's own rules, as qtool writes GGUF files that llama.cpp runs and quantizes them as
`llama-quantize` does. Each module follows one part of llama.cpp (commit 0c1e570) and says which:

    names       a Hugging Face checkpoint's tensor names in GGUF, and the q/k rows llama.cpp's
                converter permutes into its rotary order (`convert_hf_to_gguf.py`)
    model       the architecture and hyperparameter key-values llama.cpp needs to run the model
    tokenizer   the tokenizer as `tokenizer.ggml.*` key-values
    mixes       llama.cpp's file types (Q4_K_M, ...): which type each tensor gets
                (`llama_tensor_get_type`), a selection rule, not a scheme

The GGUF container itself (reading, the header bytes) is `qtool.formats`; the GGUF layout that
writes a plan through the executor is `qtool.layouts.gguf`.
"""
