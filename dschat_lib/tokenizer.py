"""The book's tokenizer: a small byte-level BPE trained offline on the shipped task.

A public tokenizer (OPT's has 50 272 entries) would make the embedding table the largest part
of a one-million-parameter model. Trained on the task's own text, a few hundred entries cover
it: every number of the task becomes one token, and so do the instruction words.

Special tokens are explicit and distinct — DeepSpeed-Chat's OPT tokenizer uses ``</s>`` as
both BOS and EOS and pads with ``<pad>``, and its reward model then has to guess where padding
starts (``num_padding_at_beginning``). Here:

- ``<pad>`` (id 0) pads and never appears in real text; attention masks hide it;
- ``<s>`` (BOS) starts every sequence: ``tokenizer(text)`` prepends it (``add_special_tokens=True``);
- ``</s>`` (EOS) ends a response; the data layer appends it to training targets and generation
  stops on it. It is never added to a prompt;
- padding is on the **left** (``padding_side="left"``), as batched generation needs: every
  prompt then ends at the same position, right where new tokens go. Training collators in
  :mod:`dschat_lib.data` pad on the right themselves.

Load with :func:`load_tokenizer` (``AutoTokenizer.from_pretrained("data/tokenizer")``);
rebuild it, with the task files, by ``python -m dschat_lib.data regenerate``
(:func:`dschat_lib.data.regenerate` calls :func:`train_tokenizer` on the training split).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable


DATA_DIR = Path(__file__).resolve().parent.parent / "data"
TOKENIZER_DIR = DATA_DIR / "tokenizer"

#: The name the presets use for the book's own tokenizer.
SHIPPED = "shipped"
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3 in this order
#: Vocabulary size of the shipped tokenizer (the BPE trainer stops when merges run out before it).
VOCAB_SIZE = 512
#: The longest sequence the shipped task needs is under 40 tokens; this is a generous ceiling.
MODEL_MAX_LENGTH = 256


def training_corpus(rows: Iterable[dict]) -> Iterable[str]:
    """Every text a model will see: prompts and all responses of the preference rows."""
    for row in rows:
        yield row["prompt"]
        for key in ("chosen", "rejected"):
            if key in row:
                yield row[key]
        yield from row.get("responses", ())


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts``.

    Byte-level means any string can be encoded (there are no unknown characters), so a model's
    free-form output always round-trips through the tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    bos_id = backend.token_to_id(BOS)
    # BOS is added by the tokenizer itself; EOS is added by whoever builds a training target.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, unk_token=UNK, padding_side="left",
                                   model_max_length=MODEL_MAX_LENGTH)


def load_tokenizer(path: str | Path = TOKENIZER_DIR):
    """The tokenizer saved at ``path`` (the shipped one by default, also named ``"shipped"`` as in
    the presets; or a Hub id), through ``AutoTokenizer``.

    Checks the properties the rest of the library relies on and says which one is missing,
    so a tokenizer from elsewhere fails here rather than as a silent wrong result later.
    """
    from transformers import AutoTokenizer

    if str(path) == SHIPPED:
        path = TOKENIZER_DIR
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    check_tokenizer(tokenizer, source=str(path))
    return tokenizer


def check_tokenizer(tokenizer, source: str = "tokenizer") -> None:
    """Raise ``ValueError`` unless the tokenizer has PAD, BOS and EOS, with PAD distinct from EOS."""
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if getattr(tokenizer, name) is None:
            raise ValueError(f"{source}: the tokenizer has no {name[:-3]} (set it before training)")
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(f"{source}: pad token and eos token share id {tokenizer.pad_token_id}; "
                         "padding would then be indistinguishable from the end of a response")
