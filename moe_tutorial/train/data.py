"""Protein sequences for language modelling: FASTA → tokens → packed training windows.

Tokenizer
---------
One token per residue, plus three special tokens:

    id  0 <pad>   1 <bos>   2 <eos>
    id  3..22     the 20 standard amino acids, in the order ACDEFGHIKLMNPQRSTVWY
    id 23         X, an unknown or non-standard residue

Rarer one-letter codes are folded into this alphabet rather than given tokens of their own,
because they are too rare to learn:

    B (Asx: Asp or Asn)  → X   the experiment could not tell the two apart; a guess may be wrong
    Z (Glx: Glu or Gln)  → X   the same ambiguity
    J (Leu or Ile)       → X   the same ambiguity (mass spectrometry cannot separate them)
    U (selenocysteine)   → C   a cysteine with selenium in place of sulphur; same role in a protein
    O (pyrrolysine)      → K   a lysine derivative

Lower-case letters are accepted and read as upper case. Anything else (digits, gaps '-', a stop
'*' inside a sequence) is an error: silently dropping characters would shift every residue after
them. Decoding gives the canonical letters, so `decode(encode("bu"))` is "XC".

Every letter of DNA and RNA (A, C, G, T, U, N) is an amino-acid code too, so a nucleotide file
would read as protein without a word (RNA's U as C): `load_sequences` refuses a file whose
residues are nearly all nucleotide letters (`check_not_nucleotides`). Line ends may be Unix,
Windows or old Mac OS (a lone carriage return) ones.

In the shipped CATH file X mostly stands for selenomethionine (CATH writes modified residues as
X; Met is 0.25% of the residues of the 5,051 sequences that contain X, 2.22% of the others). X is
kept as its own rare token (0.60% of residues) rather than mapped to M: not every X is a Met.

Packing
-------
Sequences are short (median 141 residues), so padding each to the context length would waste
most of every batch. Instead every sequence becomes `<bos> residues <eos>`, all of them are
concatenated into one token stream, and the stream is cut into windows of `seq_len + 1` tokens
with stride `seq_len`: a window gives `seq_len` inputs and the `seq_len` next tokens as labels,
and consecutive windows share one token, so every token after the first is a target exactly once.
The incomplete tail is dropped. Attention is not masked at sequence boundaries (GPT-style
packing): a window can see the end of one protein before the start of the next. That is harmless
here because the `<bos>`/`<eos>` markers tell the model where a protein starts, it learns that
what precedes `<bos>` says nothing about what follows, and no padding compute is wasted.

Train and validation sets are split at the sequence level, before packing, so no protein is
partly in both.

Data
----
`DEFAULT_FASTA` is the CATH v4.1.0 non-redundant S40 set (21,090 protein domains, CC BY 4.0;
see assets/NOTICE). On it the unigram baseline (`unigram_cross_entropy`, validation set of the
default split, seq_len=256) measured 2.948 nats per token. That includes the `<bos>`/`<eos>`
targets (1.2% of targets, each hard to predict without context); over residue targets alone it
is 2.922 nats (4.215 bits). For comparison, the residue composition of the whole file has an
entropy of 4.196 bits (2.908 nats): the same model scored on the data it was counted from.
"""

from __future__ import annotations

import gzip
import random
import re
import warnings
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..arguments import check_count
from ..locations import package_data

# ---------------------------------------------------------------------------------------------
# Tokenizer

# The protein vocabulary the course's models embed (`MoEConfig`'s default vocab_size is its size)
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
PAD_ID, BOS_ID, EOS_ID = range(len(SPECIAL_TOKENS))
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
UNKNOWN = "X"
VOCAB = (*SPECIAL_TOKENS, *AMINO_ACIDS, UNKNOWN)
VOCAB_SIZE = len(VOCAB)
ALIASES = {"B": "X", "Z": "X", "J": "X", "U": "C", "O": "K"}

_RESIDUE_IDS = {token: i for i, token in enumerate(VOCAB) if len(token) == 1}
_RESIDUE_IDS |= {alias: _RESIDUE_IDS[target] for alias, target in ALIASES.items()}
_RESIDUE_IDS |= {letter.lower(): i for letter, i in _RESIDUE_IDS.items()}
# A byte translation table: encoding a residue string is then one C call instead of a Python
# loop, which matters for the 3.4 million residues of the shipped data set.
_ID_TABLE = bytes(_RESIDUE_IDS.get(chr(byte), 255) for byte in range(256))
_INVALID_RESIDUE = re.compile(f"[^{''.join(_RESIDUE_IDS)}]")
ALLOWED_RESIDUES = (
    f"the amino acids {AMINO_ACIDS}, {UNKNOWN} (unknown) and the aliases "
    + ", ".join(f"{alias}→{target}" for alias, target in ALIASES.items())
    + ", in upper or lower case"
)


def find_invalid_residue(sequence: str) -> int | None:
    """Index of the first character the tokenizer cannot encode, or None if there is none."""
    match = _INVALID_RESIDUE.search(sequence)
    return None if match is None else match.start()


class ProteinTokenizer:
    """Residue-level tokenizer: one token per amino acid, `<bos>`/`<eos>` around a sequence."""

    vocab_size = VOCAB_SIZE

    def encode(self, sequence: str, add_special_tokens: bool = True) -> list[int]:
        bad = find_invalid_residue(sequence)
        if bad is not None:
            raise ValueError(
                f"invalid residue {sequence[bad]!r} at position {bad + 1} (1-based) of a "
                f"sequence of length {len(sequence)}; allowed are {ALLOWED_RESIDUES}"
            )
        ids = list(sequence.encode("ascii").translate(_ID_TABLE))
        return [BOS_ID, *ids, EOS_ID] if add_special_tokens else ids

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        tokens = (self.id_to_token(i) for i in ids)
        if skip_special_tokens:
            tokens = (t for t in tokens if t not in SPECIAL_TOKENS)
        return "".join(tokens)

    def id_to_token(self, token_id: int) -> str:
        if not 0 <= token_id < VOCAB_SIZE:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {VOCAB_SIZE})")
        return VOCAB[token_id]

    def token_to_id(self, token: str) -> int:
        """Id of a vocabulary token: a special token, an amino acid or X (not an alias)."""
        if token not in VOCAB:
            raise ValueError(f"{token!r} is not a token of the vocabulary {VOCAB}")
        return VOCAB.index(token)

    def __repr__(self) -> str:
        return f"ProteinTokenizer(vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------------------------
# FASTA

DEFAULT_FASTA = package_data("assets", "cath_s40_v4_1_0.fa.gz")
_GZIP_MAGIC = b"\x1f\x8b"


class FastaFormatError(ValueError):
    """A FASTA file that cannot be read; the message names the file and the line."""


@dataclass(frozen=True)
class FastaRecord:
    header: str  # the header line without the leading '>'
    sequence: str  # all sequence lines joined, whitespace and a trailing '*' removed
    line: int  # 1-based line number of the header


def _wide_encoding(start: bytes) -> str | None:
    """"UTF-32" or "UTF-16" when a file's first 4 bytes show one (a byte-order mark, as Windows'
    "Unicode" writes, or a FASTA header's ">" beside NUL bytes); None for UTF-8, ASCII or gzip.
    UTF-32's marks first: UTF-32LE's begins with UTF-16LE's."""
    if start in (b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff", b">\x00\x00\x00", b"\x00\x00\x00>"):
        return "UTF-32"
    if start[:2] in (b"\xff\xfe", b"\xfe\xff", b">\x00", b"\x00>"):
        return "UTF-16"
    return None


def _numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Yield (line number, text) of a plain or gzipped text file, one line at a time."""
    with open(path, "rb") as f:
        start = f.read(4)
    gzipped = start[:2] == _GZIP_MAGIC  # the content decides, not the file name
    wide = _wide_encoding(start)
    if wide:
        raise FastaFormatError(f"{path}: {wide} text; save it as UTF-8 (in Notepad: Save As, "
                               f"Encoding UTF-8), or convert it: iconv -f {wide} -t UTF-8")
    number = 0
    with (gzip.open if gzipped else open)(path, "rb") as f:
        try:
            # Lines are decoded one by one (not through a text wrapper that decodes whole
            # buffers) so that an undecodable byte is reported on its own line.
            for block in f:
                # Line ends as Unix (\n), Windows (\r\n) and old Mac OS (\r alone) write them
                for raw in block.splitlines():
                    number += 1
                    try:
                        # A byte-order mark (as Windows editors write) is not part of line 1.
                        yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
                    except UnicodeDecodeError:
                        raise FastaFormatError(
                            f"{path}, line {number}: not UTF-8 text; is this a binary file?"
                        ) from None
        except (gzip.BadGzipFile, EOFError, zlib.error) as error:
            # zlib reads ahead, so the damage is somewhere after the last line it gave.
            message = f"{path}, after line {number}: corrupt gzip data ({error})"
            raise FastaFormatError(message) from None


def read_fasta(path: str | Path) -> Iterator[FastaRecord]:
    """Stream the records of a FASTA file (plain or gzip), checking its structure as it goes.

    Residue characters are not checked here (that is the tokenizer's job, see `load_sequences`).
    """
    path = Path(path)
    header, header_line, chunks, lines = None, 0, [], 0

    def finish() -> FastaRecord:
        sequence = "".join(chunks)
        if sequence.endswith("*"):  # a stop codon, as many FASTA writers emit
            sequence = sequence[:-1]
        if not sequence:
            raise FastaFormatError(
                f"{path}, line {header_line}: header '>{header}' has no sequence"
            )
        return FastaRecord(header, sequence, header_line)

    for lines, text in _numbered_lines(path):
        if text.startswith(">"):
            if header is not None:
                yield finish()
            header, header_line, chunks = text[1:].strip(), lines, []
        elif text.strip():
            if header is None:
                raise FastaFormatError(
                    f"{path}, line {lines}: expected a '>' header line; is this a FASTA file?"
                )
            chunks.append("".join(text.split()))  # drop spaces inside a line and the newline
    if header is None:
        where = f"{path}, lines 1-{lines}: only blank lines" if lines else f"{path}: empty file"
        raise FastaFormatError(f"{where}; no FASTA records found")
    yield finish()


def load_sequences(
    path: str | Path | None = None, *, on_invalid: str = "raise", min_length: int = 1
) -> list[str]:
    """The sequences of a FASTA file (the shipped CATH set by default), as written in the file.

    Every sequence is checked against the tokenizer's alphabet. A record with a character the
    tokenizer cannot encode raises `FastaFormatError` (on_invalid="raise"), or is skipped with
    one warning for the whole file (on_invalid="skip"). Sequences shorter than `min_length` are
    dropped silently.
    """
    if on_invalid not in ("raise", "skip"):
        raise ValueError(f"on_invalid must be 'raise' or 'skip', not {on_invalid!r}")
    check_count("min_length", min_length)
    path = DEFAULT_FASTA if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no FASTA file at {path}")

    sequences, skipped, first_skipped, total = [], 0, "", 0
    for total, record in enumerate(read_fasta(path), start=1):
        bad = find_invalid_residue(record.sequence)
        if bad is not None:
            where = f"{path}, line {record.line}"
            if on_invalid == "raise":
                raise FastaFormatError(
                    f"{where}: record '>{record.header}' has the invalid residue "
                    f"{record.sequence[bad]!r} at position {bad + 1} of its sequence; "
                    f"allowed are {ALLOWED_RESIDUES}"
                )
            skipped += 1
            first_skipped = first_skipped or f"{where} ({record.sequence[bad]!r})"
        elif len(record.sequence) >= min_length:
            sequences.append(record.sequence)
    if skipped:
        warnings.warn(
            f"skipped {skipped} of {total} FASTA records with invalid residues; "
            f"the first at {first_skipped}",
            stacklevel=2,
        )
    check_not_nucleotides(path, sequences)
    return sequences


# Share of residues at and above which a file is taken for DNA or RNA: in proteins the letters
# A, C, G, T, U and N together make about a quarter of the residues (A 8%, G 7%, T 5%, N 4%,
# C 1%, U almost never), in nucleotide sequences all of them.
NUCLEOTIDE_SHARE = 0.9


def check_not_nucleotides(path, sequences: Sequence[str]) -> None:
    """Refuse a file of DNA or RNA sequences: its letters are valid amino-acid codes too
    (U is read as C), so it would be tokenized as protein without a word and the model would
    learn nothing a protein model should."""
    joined = "".join(sequences).upper()
    if len(joined) < 20:  # too few residues to tell
        return
    share = sum(joined.count(letter) for letter in "ACGTUN") / len(joined)
    if share >= NUCLEOTIDE_SHARE:
        kind = "RNA" if "U" in joined and "T" not in joined else "DNA"
        raise FastaFormatError(
            f"{path}: {share:.0%} of its residues are A, C, G, T, U or N: it looks like {kind} "
            f"(nucleotides), and this course models protein sequences (amino acids); translate "
            f"it to protein first (e.g. Biopython's Seq.translate) or give a protein FASTA"
        )


# ---------------------------------------------------------------------------------------------
# Splitting and packing


def _shuffled(items: Sequence[str], seed: int) -> list[str]:
    items = list(items)
    random.Random(seed).shuffle(items)
    return items


def train_val_split(
    sequences: Sequence[str], val_fraction: float = 0.05, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Shuffle whole sequences with `seed`; put `val_fraction` of them in the validation set."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), not {val_fraction}")
    n_val = round(len(sequences) * val_fraction)
    if not 0 < n_val < len(sequences):
        raise ValueError(
            f"val_fraction={val_fraction} of {len(sequences)} sequences gives {n_val} for "
            f"validation; both train and validation need at least one sequence"
        )
    shuffled = _shuffled(sequences, seed)
    return shuffled[n_val:], shuffled[:n_val]


def pack_sequences(
    sequences: Iterable[str], seq_len: int, tokenizer: ProteinTokenizer | None = None
) -> torch.Tensor:
    """Concatenate `<bos> seq <eos>` of all sequences and cut windows of `seq_len + 1` tokens.

    Returns a LongTensor [n_windows, seq_len + 1]. Windows start every `seq_len` tokens, so
    window i ends with the token window i + 1 starts with; the incomplete tail is dropped.
    """
    check_count("seq_len", seq_len)
    tokenizer = tokenizer or ProteinTokenizer()
    stream = array("q")  # 8-byte ints, so torch can use the buffer without a Python loop
    for sequence in sequences:
        stream.extend(tokenizer.encode(sequence))
    n_windows = (len(stream) - 1) // seq_len
    if n_windows < 1:
        raise ValueError(
            f"the sequences give {len(stream)} tokens, fewer than one window of "
            f"seq_len + 1 = {seq_len + 1} tokens"
        )
    stream = torch.frombuffer(stream, dtype=torch.long)[: n_windows * seq_len + 1]
    return stream.unfold(0, seq_len + 1, seq_len).clone()


def iterate_batches(
    packed: torch.Tensor,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    epochs: int | None = None,
    start: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (input_ids, labels), each [batch_size, seq_len], labels shifted by one token.

    Each epoch visits the windows in a new order drawn from one generator seeded with `seed`
    (so a run is reproducible); `epochs=None` repeats forever. The incomplete last batch of an
    epoch is dropped, so every batch has the same shape. `start=n` begins at the n-th batch of
    that same sequence (a resumed run continues where it stopped): the epochs before it only
    draw their orders, no window is copied.
    """
    if not isinstance(packed, torch.Tensor):
        raise ValueError(f"packed must be a tensor of token windows (pack_sequences' output), "
                         f"not a {type(packed).__name__}")
    if packed.dim() != 2 or packed.shape[1] < 2:
        raise ValueError(f"packed has shape {tuple(packed.shape)} ({packed.dim()} dimension(s)); "
                         f"it needs [n_windows, seq_len + 1] with seq_len >= 1, as "
                         f"pack_sequences returns")
    if packed.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"packed has dtype {packed.dtype}; token ids are integers: pack the "
                         f"sequences with pack_sequences, or convert with packed.long()")
    n_windows = packed.shape[0]
    check_count("batch_size", batch_size)
    check_count("start", start, least=0)
    if batch_size > n_windows:
        raise ValueError(
            f"batch_size={batch_size} must be between 1 and the number of windows ({n_windows})"
        )
    per_epoch = n_windows // batch_size
    generator = torch.Generator().manual_seed(seed)
    epoch, skip = divmod(start, per_epoch)
    for _ in range(epoch if shuffle else 0):
        torch.randperm(n_windows, generator=generator)  # the skipped epochs' orders
    while epochs is None or epoch < epochs:
        if shuffle:
            order = torch.randperm(n_windows, generator=generator)
        else:
            order = torch.arange(n_windows)
        for start_row in range(skip * batch_size, per_epoch * batch_size, batch_size):
            windows = packed[order[start_row : start_row + batch_size]]
            yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        epoch, skip = epoch + 1, 0


def unigram_cross_entropy(train_packed: torch.Tensor, eval_packed: torch.Tensor) -> float:
    """Cross-entropy (nats per token) of the best context-free model on the evaluation targets.

    The model predicts every token with its frequency among the training targets (add-one
    smoothed, so no token has probability zero). A language model that does not beat this has
    learned only the amino-acid composition.
    """
    counts = torch.bincount(train_packed[:, 1:].flatten(), minlength=VOCAB_SIZE).double() + 1
    log_probs = (counts / counts.sum()).log()
    return -log_probs[eval_packed[:, 1:].flatten()].mean().item()


# ---------------------------------------------------------------------------------------------
# Everything together


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors field by field is ambiguous
class ProteinData:
    train: torch.Tensor  # packed windows [n_train, seq_len + 1]
    val: torch.Tensor  # packed windows [n_val, seq_len + 1]
    tokenizer: ProteinTokenizer
    num_sequences: int  # sequences used, train and validation together
    unigram_nats: float  # unigram baseline on `val`: the loss a model must beat
    source: Path


def load_protein_data(
    seq_len: int,
    *,
    val_fraction: float = 0.05,
    seed: int = 0,
    path: str | Path | None = None,
    max_sequences: int | None = None,
) -> ProteinData:
    """Load a FASTA file (the shipped CATH set by default), split it and pack both sides.

    `max_sequences` keeps a random subset (the first N after a shuffle with `seed`) for fast
    tests and small runs.
    """
    # Checked before the file is read: a bad size would otherwise fail only after it.
    check_count("seq_len", seq_len)
    if max_sequences is not None:
        check_count("max_sequences", max_sequences)
    source = DEFAULT_FASTA if path is None else Path(path)
    sequences = load_sequences(source)
    if max_sequences is not None:
        sequences = _shuffled(sequences, seed)[:max_sequences]
    train, val = train_val_split(sequences, val_fraction, seed)
    tokenizer = ProteinTokenizer()
    train_packed = pack_sequences(train, seq_len, tokenizer)
    val_packed = pack_sequences(val, seq_len, tokenizer)
    return ProteinData(
        train=train_packed,
        val=val_packed,
        tokenizer=tokenizer,
        num_sequences=len(sequences),
        unigram_nats=unigram_cross_entropy(train_packed, val_packed),
        source=source,
    )
