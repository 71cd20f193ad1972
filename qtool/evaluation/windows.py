"""A text cut into the windows `qtool eval` scores, as `llama-perplexity` cuts them, so that
the two tools' perplexities compare (tools/perplexity/perplexity.cpp, `perplexity()`):

    the text tokenized with the model's tokenizer, a BOS first where the tokenizer adds one
    -> consecutive windows of `ctx` tokens from the start (the tail shorter than a window dropped;
       `windows` caps the count)
    -> each window's first token replaced by the BOS (where the tokenizer adds one)
    -> scored: the positions ctx/2 .. ctx-2, each predicting the next token (ctx - 1 - ctx/2 per window)

The text is read and tokenized a piece at a time (`qtool.calibration.samples`: a document, or a
long one's pieces of at most a million characters cut at a paragraph break) until the windows
asked for are full, so a text of documents under that size gives the tokens it gives whole.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qtool.errors import UsageError

if TYPE_CHECKING:
    import torch

    from qtool.calibration.samples import CalibrationText

__all__ = ["WindowOptions", "Windows", "text_windows", "adds_bos"]


@dataclass(frozen=True)
class WindowOptions:
    ctx: int = 512  # tokens per window
    windows: int | None = None  # the first N windows; None: every whole window of the text

    def check(self) -> None:
        if self.ctx < 4:
            raise UsageError(f"a window of {self.ctx} tokens is too short to score (at least 4)", option="ctx")
        if self.windows is not None and self.windows < 1:
            raise UsageError(f"{self.windows} windows: at least 1 is needed", option="windows")


@dataclass(frozen=True)
class Windows:
    """The token ids every model of one evaluation runs on."""

    tokens: torch.Tensor  # [windows, ctx] int64, each window's first token the BOS where the tokenizer adds one
    bos: int | None  # the BOS id the windows start with; None where the tokenizer adds none
    text_tokens: int  # the tokens read from the text (BOS included), of which the windows use the first windows x ctx

    @property
    def ctx(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def first(self) -> int:
        """The first scored position: the model always has half a window of context."""
        return self.ctx // 2

    @property
    def scored_per_window(self) -> int:
        return self.ctx - 1 - self.first


def adds_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer puts before a text, or None (GPT-2-style tokenizers add none):
    what `llama_vocab_get_add_bos` says of a GGUF's vocabulary."""
    from qtool.calibration.samples import tokenized

    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    plain = tokenized(tokenizer, "a", add_special_tokens=False)
    special = tokenized(tokenizer, "a", add_special_tokens=True)
    return int(bos) if len(special) > len(plain) and special[0] == bos else None


def text_windows(text: CalibrationText, tokenizer, options: WindowOptions) -> Windows:
    """The windows of `text` (see the module's docstring); a text shorter than one window is a
    one-line refusal saying how many tokens it has."""
    import torch

    from qtool.calibration.samples import token_pieces

    options.check()
    bos = adds_bos(tokenizer)
    ids = array("q", [] if bos is None else [bos])
    wanted = None if options.windows is None else options.windows * options.ctx
    for piece in token_pieces(text, tokenizer):
        ids.extend(piece if wanted is None else piece[: wanted - len(ids)])
        if wanted is not None and len(ids) >= wanted:
            break
    count = len(ids) // options.ctx
    if count < 1:
        raise UsageError(
            f"{text.path}: the text has {len(ids)} tokens, fewer than one window of {options.ctx}",
            hint="give a longer text or a shorter window",
            option="ctx",
        )
    tokens = torch.frombuffer(ids, dtype=torch.int64)[: count * options.ctx].view(count, options.ctx).clone()
    if bos is not None:
        tokens[:, 0] = bos
    return Windows(tokens, bos, len(ids))
