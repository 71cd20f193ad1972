"""A GGUF's vocabulary as transformers' tokenizer, read by qtool.

transformers builds a tokenizer from a GGUF (`AutoTokenizer` given `gguf_file=`) by reading the file with its own reader. qtool reads the `tokenizer.*`
key-values with its bounded reader and checks them (`GgufMetadata`: the token count against the
token embedding's rows, every id in range, every string UTF-8), then hands them to transformers'
own converter (`convert_gguf_tokenizer`) in the form transformers' reader gives them, and builds
the class AutoTokenizer would: the same ids, and the same BOS, as transformers' own reading. No
BPE of qtool's: the converter is transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qtool.errors import CheckpointError, QtoolError, UsageError
from qtool.evaluation.gguf_metadata import FLOATS, INTEGERS, GgufMetadata
from qtool.message_text import excerpt

__all__ = ["GgufVocabulary"]


@dataclass(frozen=True)
class GgufVocabulary:
    """The `tokenizer.*` key-values, read and checked when the view is made (the token count
    against token_embd's rows, every id in range), converted only when a tokenizer is asked for."""

    metadata: GgufMetadata
    architecture: str

    @classmethod
    def read(cls, metadata: GgufMetadata, vocab_size: int) -> GgufVocabulary | None:
        if "tokenizer.ggml.model" not in metadata and "tokenizer.ggml.tokens" not in metadata:
            return None
        metadata.text("tokenizer.ggml.model", required=True)
        tokens, _ = metadata.array("tokenizer.ggml.tokens", ("STRING",)) or (None, "")
        if tokens is None:
            raise metadata.fail("tokenizer.ggml.tokens", "is missing")
        if len(tokens) != vocab_size:
            raise metadata.fail(
                "tokenizer.ggml.tokens", f"holds {len(tokens)} tokens, but token_embd.weight has {vocab_size} rows"
            )
        for key, kinds in (("tokenizer.ggml.scores", FLOATS), ("tokenizer.ggml.token_type", INTEGERS)):
            values = metadata.array(key, kinds)
            if values is not None and len(values[0]) != vocab_size:
                raise metadata.fail(key, f"holds {len(values[0])} values, not one per token ({vocab_size})")
        metadata.array("tokenizer.ggml.merges", ("STRING",))
        for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
            metadata.token_id(f"tokenizer.ggml.{key}", vocab_size)
        for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
            metadata.flag(f"tokenizer.ggml.{key}")
        metadata.text("tokenizer.ggml.pre")
        metadata.text("tokenizer.chat_template")
        return cls(metadata, metadata.text("general.architecture", required=True))

    def _value(self, key: str) -> Any:
        """One key's value as transformers' GGUF reader gives it: text as str, arrays as lists."""
        value, kind = self.metadata.values[key]
        if kind == "STRING":
            return self.metadata.utf8(key, value)
        if kind == "ARRAY:STRING":
            return [self.metadata.utf8(key, item, index) for index, item in enumerate(value)]
        return list(value) if kind.startswith("ARRAY:") else value

    def inputs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tokenizer_dict, tokenizer_config) as transformers' `get_gguf_tokenizer` makes them
        from a file (its GGUF_TOKENIZER_MAPPING; a "llama" vocabulary adds BOS unless it says
        not to; the special tokens as text), from qtool's reading of the key-values."""
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

        grouped = {
            group: {name: self._value(f"tokenizer.{key}") for key, name in renames.items() if f"tokenizer.{key}" in self.metadata}
            for group, renames in GGUF_TOKENIZER_MAPPING.items()
        }  # fmt: skip
        tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
        if tokenizer.get("tokenizer_type") == "llama":
            tokenizer_config.setdefault("add_bos_token", True)
        for name, key in (
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("unk_token", "unknown"),
            ("pad_token", "padding"),
        ):
            token_id = self.metadata.values.get(f"tokenizer.ggml.{key}_token_id", (None,))[0]
            tokenizer_config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
        return tokenizer, tokenizer_config

    def build(self, path: str, model_type: str, notes: list[str]) -> Any:
        """transformers' converter on the vocabulary, in the tokenizer class AutoTokenizer picks
        for `model_type` (its TOKENIZER_MAPPING, else TokenizersBackend). Whatever it raises,
        a Rust panic included, is one CheckpointError naming the file."""
        from qtool.formats.transformers_boundary import collected, tokenizer_panics

        try:
            tokenizer_dict, tokenizer_config = self.inputs()
            with collected(notes, "transformers: "), tokenizer_panics(path):
                from transformers.integrations.gguf import convert_gguf_tokenizer

                backend, extra = convert_gguf_tokenizer(self.architecture, tokenizer_dict)
                return _tokenizer_class(model_type)(tokenizer_object=backend, **tokenizer_config, **extra)
        except QtoolError:
            raise
        except ImportError as exc:
            raise UsageError(
                f"reading a GGUF's tokenizer needs transformers ({exc})", hint="pip install 'qtool[calibrate]'"
            ) from None
        except Exception as exc:
            detail = excerpt(" ".join(str(exc).split())) or type(exc).__name__
            raise CheckpointError(
                f"transformers cannot build its tokenizer: {detail}",
                path=path,
                hint="the GGUF's tokenizer.ggml.* keys do not describe a tokenizer transformers has",
            ) from None


def _tokenizer_class(model_type: str) -> type:
    """The class `AutoTokenizer` builds a GGUF's tokenizer in for this model type (a folder
    holding the GGUF has no tokenizer_config.json to say otherwise)."""
    from transformers import TokenizersBackend
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    chosen = TOKENIZER_MAPPING.get(CONFIG_MAPPING[model_type], TokenizersBackend)
    if chosen is None or getattr(chosen, "__name__", None) == "MistralCommonBackend":
        return TokenizersBackend
    return chosen
